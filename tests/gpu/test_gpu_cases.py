"""The GPU suite on the host, so a broken case fails `make test` before it reaches a GPU: every case's worker takes
the arguments it is given, a few cases run as the suite runs them (world 2, gloo) and pass, and the placement probe
notes what it must (a tensor off its device, a wrong current CUDA device)."""

import inspect

import pytest
import torch
from helpers.dist_workers import train_params
from helpers.gpu_cases import layouts, one_gpu
from helpers.gpu_job import Case, judge, run_job
from helpers.placement import Placement
from torch import nn

import paratrain
from paratrain.testing import alive, child_pids, spawn

EVERY_LIST = [(f"world {w} {a}", layouts(w, a, "/x")) for w in (2, 4) for a in ("cuda", "cpu")]
EVERY_LIST += [(f"one gpu {a}", one_gpu(a, "/x")) for a in ("cuda", "cpu")]
SMOKE = ("ddp, its own group", "async save zero3")  # one case starts its group, one runs in the job's
# (cpu_offload pins host memory: CUDA only)


@pytest.mark.parametrize("label, cases", EVERY_LIST, ids=[label for label, _ in EVERY_LIST])
def test_every_case_binds_its_workers_arguments(label, cases):
    assert len({c.name for c in cases}) == len(cases), "two cases share a name"
    for case in cases:
        inspect.signature(case.fn).bind(*case.args, **case.kwargs)  # TypeError names the argument
        assert case.home in ("device", "cpu") and (case.verdict is None or callable(case.verdict)), case.name


def test_the_case_names_do_not_depend_on_the_accelerator():
    for world in (2, 4):
        assert [c.name for c in layouts(world, "cpu", "/a")] == [c.name for c in layouts(world, "cuda", "/b")]
    assert [c.name for c in one_gpu("cpu", "/a")] == [c.name for c in one_gpu("cuda", "/b")]


@pytest.mark.launched
@pytest.mark.timeout(120)
def test_some_cases_run_on_gloo_as_the_gpu_suite_runs_them(tmp_path):
    """And a case that fails is reported with each rank's traceback while the next case still runs."""
    cases = [c for c in layouts(2, "cpu", str(tmp_path)) if c.name in SMOKE]
    failing = Case("refused", train_params, ("no-such-strategy", 1, 1, 8, 2), own_group=True)
    ranks = spawn(run_job, 2, ([failing, *cases], "cpu"), timeout_s=100)
    assert not alive(child_pids())
    for case in cases:
        problems = judge(ranks, case)
        assert not problems, "\n".join(problems)
    problems = judge(ranks, failing)
    assert len(problems) == 2, problems
    for rank, problem in enumerate(problems):
        assert problem.startswith(f"rank {rank}: UnknownStrategyError: unknown strategy 'no-such-strategy'"), problem
        assert "Traceback (most recent call last)" in problem


def _stepped(probe: Placement, model: nn.Module) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()  # torch's global step hook: the probe looks at every step of every optimizer


def test_the_probe_sees_each_step_and_names_a_tensor_off_its_device():
    probe = Placement("cpu")
    with probe.watching():
        _stepped(probe, nn.Linear(4, 2))
    assert probe.steps == 1 and probe.misplaced == []
    offloaded = Placement("cpu", home="device")
    offloaded.home = torch.device("meta")  # as if the parameters belonged elsewhere
    with offloaded.watching():
        _stepped(offloaded, nn.Linear(4, 2))
    assert any("parameter" in m and "not meta" in m for m in offloaded.misplaced), offloaded.misplaced
    assert any("gradient" in m for m in offloaded.misplaced)
    assert any("momentum_buffer" in m for m in offloaded.misplaced)


def test_the_probe_checks_what_parallel_prepared():
    probe = Placement("cpu")
    probe.device = torch.device("meta")  # a rank whose device is elsewhere: every prepared tensor is off it
    with probe.watching():
        par = paratrain.Parallel("single", accelerator="cpu", monitor=False)
        par.prepare(nn.BatchNorm1d(4))
        par.close()
    assert any(m.startswith("buffer running_mean after prepare") for m in probe.misplaced), probe.misplaced


def test_the_probe_names_a_rank_left_on_gpu_0(monkeypatch):
    """Rank 1 whose current device stayed 0 (nothing called ``torch.cuda.set_device``)."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    probe = Placement("cuda")
    probe.home = torch.device("cpu")  # the host's tensors stand for cuda:1's here
    with probe.watching():
        _stepped(probe, nn.Linear(4, 2))
    assert probe.misplaced == ["current CUDA device 0 at optimizer step 1, not 1"]
