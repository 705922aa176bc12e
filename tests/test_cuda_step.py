"""The CUDA-shaped lane: one training step of a layout as rank r of a 4-GPU NCCL job, on fake ``cuda:LOCAL_RANK``
devices, in one CUDA-shaped child process for every case (:mod:`paratrain.cuda_step`; about 20 s on 2 cores).

Each case asserts what a GPU run needs: the current device set where the group starts (FSDP2 shards on it), a host
backend beside NCCL for CPU offload's clipping, CUDA's foreach optimizer path with DTensor experts beside plain
parameters. The unit tests check the group's backend rule itself: an NCCL group takes no CPU tensor, and no tensor
of another rank's GPU.
"""

from __future__ import annotations

import pytest
import torch
from helpers import zoo

from paratrain.cuda_step import Placement, first_steps, served
from paratrain.dry_run.probe import dry_run
from paratrain.errors import ConfigError

GPT2 = "helpers.zoo:gpt2"
MIXTRAL = "helpers.moe_models:tiny_mixtral"
CASES = {  # name: (strategy, rank, options, model)
    "ddp": ("ddp", 0, {}, GPT2),
    "zero3 rank 1": ("zero3", 1, {}, GPT2),
    "ep under ddp": ("ddp", 0, {"ep": 2}, MIXTRAL),
    "zero3 cpu_offload": ("zero3", 0, {"cpu_offload": True}, GPT2),
}


def _spec(strategy: str, rank: int, options: dict, model: str) -> dict:
    return {
        "rank": rank,
        "world": 4,
        "per_node": 8,
        "strategy": strategy,
        "options": options,
        "precision": "fp32",
        "model": model,
        "model_config": None,
        "input": None,
        "batch": 2,
        "seq_len": 16,
        "clip": 1.0,
    }


@pytest.fixture(scope="module")
def steps():
    try:
        results = first_steps([_spec(*case) for case in CASES.values()])
    except ConfigError as err:  # no C++ compiler or ninja here: the lane cannot be made
        pytest.skip(str(err))
    return dict(zip(CASES, results, strict=True))


def _passes(result) -> None:
    assert result.passed, result.error
    assert result.device == f"cuda:{result.rank}"


@pytest.mark.launched
@pytest.mark.timeout(300)
def test_ddp_step_passes_and_peaks_above_what_the_rank_holds(steps):
    _passes(steps["ddp"])
    held = dry_run(zoo.gpt2, world=4, strategy="ddp").ranks[0]
    assert steps["ddp"].peak > held.total  # states, and activations beside them


@pytest.mark.launched
@pytest.mark.timeout(300)
def test_zero3_rank_1_trains_on_its_own_gpu(steps):
    _passes(steps["zero3 rank 1"])


@pytest.mark.launched
@pytest.mark.timeout(300)
def test_ep_under_ddp_steps_on_cudas_foreach_path(steps):
    _passes(steps["ep under ddp"])


@pytest.mark.launched
@pytest.mark.timeout(300)
def test_cpu_offload_clips_on_a_group_that_takes_host_tensors(steps):
    _passes(steps["zero3 cpu_offload"])


@pytest.mark.parametrize(
    "backend, takes", [("nccl", {"cuda"}), ("gloo", {"cpu", "cuda"}), ("cpu:gloo,cuda:nccl", {"cpu", "cuda"})]
)
def test_backends_serve_their_device_types(backend, takes):
    assert served(backend) == takes


def test_an_nccl_group_refuses_host_tensors_and_other_gpus():
    rank1 = torch.device("cuda", 1)
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        Placement("nccl", rank1).check("all_reduce", [torch.zeros(2)])
    Placement("cpu:gloo,cuda:nccl", rank1).check("all_reduce", [torch.zeros(2)])
    Placement("nccl", rank1).check("all_reduce", [_on(rank1)])
    with pytest.raises(RuntimeError, match="on cuda:0 from the rank on cuda:1"):
        Placement("nccl", rank1).check("all_reduce", [_on(torch.device("cuda", 0))])


def _on(device: torch.device) -> torch.Tensor:
    """A fake tensor on ``device`` (a CPU-only torch makes fake CUDA tensors)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(2, device=device)


def test_the_table_shows_each_rank_its_peak_and_each_failure():
    from paratrain.cuda_step import StepResult
    from paratrain.dry_run.command import steps_table

    table = steps_table(
        [
            StepResult(rank=0, device="cuda:0", passed=True, peak=3 * 2**29),
            StepResult(rank=8, device="cuda:0", passed=False, ran=False, error="not run: stages"),
            StepResult(rank=63, device="cuda:7", passed=False, error="RuntimeError: no backend"),
        ]
    )
    rows = table.splitlines()
    assert rows[2].split() == ["0", "cuda:0", "passes", "1.500"]
    assert rows[3].split() == ["8", "cuda:0", "not", "run", "-"]
    assert rows[4].split() == ["63", "cuda:7", "FAILS", "-"]
    assert rows[5:] == ["rank 8: not run: stages", "rank 63: RuntimeError: no backend"]
