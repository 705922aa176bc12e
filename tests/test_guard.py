"""The numerics guard (``Parallel(guard=...)``, :mod:`paratrain.guard`).

One launched world-2 job runs every layout as a case (ddp, zero3, tp, a pipeline): a NaN on one rank is skipped by
every rank, leaving the state of a run that never saw that batch; so is a loss spike; two skips in a row reload the
checkpoint and read on; with nothing to guard, the guard changes no bit. The unit tests check the config, the
accumulation window, the one host read per step and the one-line errors in one process.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import paratrain
from paratrain.guard import GuardConfig, guard_config
from paratrain.testing.host_syncs import HostSyncs

LAYOUTS = {
    "ddp": ("ddp", {}),
    "zero3": ("zero3", {}),
    "tp": ("tp", {"tp_plan": {"2": "colwise", "4": "rowwise"}}),
    "pipeline": ("pipeline", {"schedule": "gpipe", "microbatches": 2}),
}


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> list[dict]:
    from helpers.cases import each_call
    from helpers.guard_workers import guard_case

    from paratrain.testing import spawn

    root = str(tmp_path_factory.mktemp("guard"))
    calls = [(name, guard_case, (strategy, options, root), {}) for name, (strategy, options) in LAYOUTS.items()]
    return spawn(each_call, 2, (calls,), timeout_s=150)


def _equal(a: dict, b: dict) -> bool:
    """The same model and optimizer state, bit for bit."""
    same_model = a["model"].keys() == b["model"].keys() and all(
        torch.equal(a["model"][k], b["model"][k]) for k in a["model"]
    )
    return same_model and _same(a["optim"], b["optim"])


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@pytest.mark.launched
@pytest.mark.timeout(170)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_rank_skips_alike_and_reloads(world2, layout):
    ranks = [world2[r][layout] for r in range(2)]
    assert "error" not in ranks[0], ranks[0]
    for run in ranks:
        assert _equal(run["on"]["states"][-1], run["off"]["states"][-1])  # nothing to guard: not one bit changed
        after = run["bad"]["states"]
        assert _equal(after[1], after[2])  # batch 2 (a NaN on rank 1): as if never stepped on
        assert _equal(after[3], after[0])  # batch 3 spiked, the second skip in a row: the save after batch 0 reloaded
        assert _equal(after[5], run["on"]["states"][-1])  # and batches 2, 3 passed over
        assert [run["on"]["skipped"], run["bad"]["skipped"], run["bad"]["reloads"]] == [0, 2, 1]
    nan, spike = ranks[0]["bad"]["lines"]
    assert ranks[1]["bad"]["lines"] == [nan, spike]  # every rank decided alike (rank 0 prints)
    assert nan.startswith("paratrain: guard: skipped optimizer step 3 (loss nan; gradient norm nan; first non-finite")
    assert "x the median" in spike and "2 in a row, 2 in all" in spike


def _run(feed, *, guard=True, nan=(), accumulate=1, optimizer=torch.optim.Adam, syncs=None, monitor=False, **kwargs):
    """One process: ``feed`` batch indices (``accumulate`` micro-batches each); NaN in the micro-batches ``nan``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    par = paratrain.Parallel("single", monitor=monitor, guard=guard, accumulate=accumulate, **kwargs)
    model, opt = par.prepare(model, optimizer(model.parameters(), lr=0.1))
    logged = []
    par.trackers.log = lambda metrics, step: logged.append((metrics, step))
    xs = torch.randn(16, 5, 4, generator=torch.Generator().manual_seed(1))
    for b in feed:
        for m in range(accumulate):
            x = xs[b * accumulate + m].clone()
            if b * accumulate + m in nan:
                x[0, 0] = float("inf")
            with syncs if syncs is not None and b == feed[-1] else _nothing(), par.step(model, opt):
                par.forward_backward(model, x, torch.zeros(5, 1), nn.functional.mse_loss)
    state = {k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict()
    guard_state = par._loop.guard
    if monitor:
        assert logged == [({"guard/skipped_steps": 1}, 2)]  # the trackers' count, at the step skipped
        assert par.monitor.skipped_steps == guard_state.skipped
        assert (
            f"skipped by the numerics guard: {guard_state.skipped} optimizer step(s)" in par.monitor.summary().table()
        )
    par.close()
    return state, guard_state


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def _same_state(a, b) -> bool:
    return _same(a[0], b[0]) and _same(a[1]["state"], b[1]["state"])


def test_an_inf_in_one_micro_batch_skips_its_whole_window():
    (bad, guard) = _run([0, 1, 2], nan=(3,), accumulate=2, monitor=True)  # micro-batch 3: the second of step 2
    (clean, _) = _run([0, 2], accumulate=2)
    assert _same_state(bad, clean)
    assert (
        guard.skipped == 1
        and "step 2 (gradient norm nan; first non-finite gradient: 0.weight (rank 0))" in guard.lines[0]
    )


@pytest.mark.parametrize("fused", [False, True])
def test_one_host_read_per_step(fused):
    """The guard's decision is one 0-d flag read once per optimizer step, whatever the optimizer: a second read
    (the loss, the norm) would stall a GPU's queue again on every step."""
    counted = {}
    for guard in (False, True):
        syncs = HostSyncs()
        opt = lambda params, lr: torch.optim.Adam(params, lr=lr, fused=fused)  # noqa: E731
        _run([0, 1], guard=guard, optimizer=opt, syncs=syncs)
        counted[guard] = syncs.count
    assert counted[True] - counted[False] == 1, counted


def test_config_is_checked_in_one_line():
    assert guard_config(True) == GuardConfig() and guard_config(False) is None
    for bad in ({"spike": 1.0}, {"window": 0}, {"reload_after": 0}, {"spike": True}, {"spike": "10"}):
        with pytest.raises(paratrain.ConfigError, match="GuardConfig"):
            GuardConfig(**bad)
    with pytest.raises(paratrain.ConfigError, match="guard= takes"):
        guard_config("yes")


def test_a_run_of_skips_without_a_checkpoint_is_one_line():
    with pytest.raises(paratrain.ConfigError, match="2 optimizer steps skipped in a row and no checkpoint directory"):
        _run([0, 1, 2], nan=(1, 2), guard=GuardConfig(reload_after=2))


def test_loss_scaling_keeps_its_own_overflow_skips():
    """fp16-mixed (CUDA): an overflow is the grad scaler's to skip (it lowers its scale and goes on), not a guard skip
    that would reload after a few; a step the guard skips for its loss still ends the scaler's step (its update), or
    the next unscale would refuse. Run here on the CPU scaler torch has."""
    from paratrain.precision import FP16Mixed, ScalerByLayout

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    par = paratrain.Parallel("single", monitor=False, guard=GuardConfig(reload_after=None))
    model, opt = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    par.precision = FP16Mixed()
    par.precision.scaler = ScalerByLayout("cpu")
    x = torch.randn(5, 4)
    for scale in (1e36, 1.0, float("nan"), 1.0):  # a loss that overflows once scaled, a clean step, a NaN, a clean one
        with par.step(model, opt):
            par.forward_backward(
                model, x, torch.zeros(5, 1), lambda out, y, s=scale: nn.functional.mse_loss(out, y) * s
            )
    assert par.precision.scaler.get_scale() == 2.0**14  # the overflow and the NaN halved it
    assert par._loop.guard.skipped == 1 and "loss nan" in par._loop.guard.lines[0]
