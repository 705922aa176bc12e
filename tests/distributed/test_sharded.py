"""Every data-parallel and model-parallel strategy equals one process on the same global batch (real gloo runs),
and sharding really shrinks per-rank state by the ZeRO accounting.

One launched job per world size runs every case of the file (``helpers.cases.each_call``): a launch costs more than
training the small model.
"""

import pytest
import torch
from helpers.cases import each_call
from helpers.dist_workers import build_model, global_batches, split_evaluation, state_bytes, train_params

from paratrain.planner import ModelSpec, PlanConfig, Training, make_plan
from paratrain.planner.memory import model_states
from paratrain.testing import max_abs_diff, spawn
from paratrain.workloads.model_names import resolve_model

STEPS, BATCH = 20, 8
SMALL_UNITS = {"min_params": 100}  # the test model's blocks are small: make each one a sharding unit
EQUAL = [
    ("zero1", 2, 1, {}),
    ("zero1", 2, 3, {}),
    ("zero2", 2, 1, SMALL_UNITS),
    ("zero2", 2, 2, SMALL_UNITS),
    ("zero3", 2, 1, SMALL_UNITS),
    ("zero3", 2, 2, SMALL_UNITS),
    ("zero3", 4, 1, {}),  # default policy: the whole model is one unit
    ("hsdp", 4, 1, SMALL_UNITS),
    ("hsdp", 4, 2, SMALL_UNITS),
    ("model_parallel", 2, 2, {"stages": 3}),  # data x model parallel: DDP over a 3-stage model
]
CLIP = {"clip_grad_norm": 0.05}  # small enough to clip every step
BF16 = [("ddp", {}), ("zero3", SMALL_UNITS)]
HOOKS = [("fp16", 5e-4), ("bf16", 3e-3), ("powersgd", 0.1)]
STATE_STRATEGIES = ("ddp", "zero1", "zero2", "zero3")


def _calls(world: int) -> list[tuple]:
    """Every launched case of this file at ``world`` processes."""
    calls = [(f"{s} {w} {a} {o}", train_params, (s, a, STEPS, BATCH, w, o), {}) for s, w, a, o in EQUAL if w == world]
    calls += [(f"state {s}", state_bytes, (s,), {}) for s in STATE_STRATEGIES]
    if world == 2:
        calls.append(("clip", train_params, ("zero3", 1, STEPS, BATCH, 2, SMALL_UNITS), CLIP))
        calls.append(
            ("clip offload", train_params, ("zero3", 1, STEPS, BATCH, 2, {**SMALL_UNITS, "cpu_offload": True}), CLIP)
        )
        calls += [(f"bf16 {s}", train_params, (s, 1, STEPS, BATCH, 2, o), {"precision": "bf16-mixed"}) for s, o in BF16]
        calls += [
            (f"hook {h}", train_params, ("ddp", 1, STEPS, BATCH, 2, {"comm_hook": h, "powersgd_start_iter": 2}), {})
            for h, _ in HOOKS
        ]
        calls += [(f"evaluation evenly={e}", split_evaluation, (e, SMALL_UNITS), {}) for e in (True, False)]
    return calls


@pytest.fixture(scope="module")
def world2() -> list[dict]:
    return spawn(each_call, 2, (_calls(2),), timeout_s=240)


@pytest.fixture(scope="module")
def world4() -> list[dict]:
    return spawn(each_call, 4, (_calls(4),), timeout_s=240)


def _serial(accumulate: int, world: int, **parallel_kwargs) -> dict:
    return train_params("single", accumulate, STEPS, BATCH * world, 1, **parallel_kwargs)


@pytest.mark.launched
@pytest.mark.parametrize("strategy, world, accumulate, options", EQUAL)
def test_parallel_equals_serial(request, strategy, world, accumulate, options):
    ranks = request.getfixturevalue(f"world{world}")
    serial = _serial(accumulate, world)
    for results in ranks:
        assert max_abs_diff(results[f"{strategy} {world} {accumulate} {options}"], serial) <= 1e-5, strategy


@pytest.mark.parametrize("split", [[1], [2, 4], None])
def test_model_parallel_in_one_process_equals_serial(split):
    options = {"split": split} if split else {"stages": 5}
    assert max_abs_diff(train_params("model_parallel", 2, STEPS, BATCH, 1, options), _serial(2, 1)) <= 1e-6


def test_dp_on_cpu_runs_as_one_device_and_says_why():
    with pytest.warns(UserWarning, match="'ddp' with one process per device"):
        params = train_params("dp", 1, STEPS, BATCH, 1)
    assert max_abs_diff(params, _serial(1, 1)) <= 1e-6


@pytest.mark.launched
def test_sharded_gradient_clipping_equals_serial_clipping(world2):
    serial = _serial(1, 2, **CLIP)
    assert max_abs_diff(world2[0]["clip"], serial) <= 1e-5
    assert max_abs_diff(world2[0]["clip offload"], serial) <= 1e-5  # shards in host memory (unpinned on a CPU job)
    assert max_abs_diff(serial, _serial(1, 2)) > 1e-3  # clipping changed the result


@pytest.mark.launched
@pytest.mark.parametrize("strategy, options", BF16)
def test_bf16_mixed_is_close_to_serial_bf16(world2, strategy, options):
    got = world2[0][f"bf16 {strategy}"]
    serial = _serial(1, 2, precision="bf16-mixed")
    # bf16 keeps 8 mantissa bits: the parallel and serial runs round differently, but stay close
    assert max_abs_diff(got, serial) <= 3e-3
    assert max_abs_diff(got, _serial(1, 2)) <= 3e-3


@pytest.mark.launched
@pytest.mark.parametrize("hook, tolerance", HOOKS)
def test_ddp_comm_hooks(world2, hook, tolerance):
    a, b = (results[f"hook {hook}"] for results in world2)
    serial = _serial(1, 2)
    assert 0 < max_abs_diff(a, serial) <= tolerance  # compressed: close, never bitwise
    assert max_abs_diff(a, b) == 0.0


@pytest.mark.launched
@pytest.mark.parametrize("world", [2, 4])
def test_zero_stages_shrink_per_rank_state_by_the_zero_accounting_and_the_planner_predicts_it(request, world):
    ranks = request.getfixturevalue(f"world{world}")
    results = {s: _largest([r[f"state {s}"] for r in ranks]) for s in STATE_STRATEGIES}
    p = results["ddp"]["full_params"]  # fp32 parameters, bytes
    expected = {  # (params, grads, Adam state) per rank, in bytes
        "ddp": (p, p, 2 * p),
        "zero1": (p, p, 2 * p / world),
        "zero2": (p, p / world, 2 * p / world),
        "zero3": (p / world, p / world, 2 * p / world),
    }
    for strategy, (ep, eg, eo) in expected.items():
        got = results[strategy]
        for key, want in (("params", ep), ("grads", eg), ("optim", eo)):
            assert abs(got[key] - want) <= 0.05 * want, (strategy, key, got[key], want)
    # the planner, which never runs the model, predicts the same bytes
    plan = make_plan(
        resolve_model(ModelSpec(model="helpers.dist_workers:state_model", input_spec="64")),
        PlanConfig(gpu="cpu", gpus=world, training=Training(precision="fp32", optimizer="adam", micro_batch=4)),
    )
    predicted = {e.name: model_states(plan.stats, e.layout, plan.training) for e in plan.estimates}
    for strategy, got in results.items():
        memory = predicted[strategy]
        for key, planned in (
            ("params", memory.parameters),
            ("grads", memory.gradients),
            ("optim", memory.optimizer_states),
        ):
            assert abs(planned - got[key]) <= 0.05 * got[key], (strategy, key, planned, got[key])


def _largest(ranks: list[dict[str, int]]) -> dict[str, int]:
    """Per key, the largest count over ranks (ZeRO-1 can shard unevenly)."""
    return {key: max(r[key] for r in ranks) for key in ranks[0]}


@pytest.mark.launched
def test_an_evaluation_split_unevenly_runs_through_map_evenly_and_equals_one_process(world2):
    """3 examples on rank 0, 2 on rank 1: rank 1 repeats one forward and drops it; the sum is one process's."""
    x, y = global_batches(1, 5)
    with torch.no_grad():
        one = float(torch.nn.functional.cross_entropy(build_model()(x), y, reduction="sum"))
    for results in world2:
        assert results["evaluation evenly=True"]["line"] is None
        assert results["evaluation evenly=True"]["total"] == pytest.approx(one, abs=1e-5)


@pytest.mark.launched
def test_an_evaluation_split_unevenly_stops_in_one_line_saying_so(world2):
    line = world2[0]["evaluation evenly=False"]["line"]
    assert line is not None
    assert line.startswith("rank 0 ran the model's forward more times than rank 1: rank 1 ran it 2 times and went on")
    assert "par.sum #1" in line and "is in its #3 (dist_workers.py:" in line, line
    assert "under zero3" in line and "par.map_evenly(fn, batches)" in line, line
    assert world2[1]["evaluation evenly=False"]["line"] is None
