"""Where a rank's group starts on an 8-GPU node, checked on this CPU (helpers/cuda_shaped.py): the rank's GPU is the
current device before the first collective, and the group's backend serves every tensor the strategy sends."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers.cuda_shaped import CudaShaped, cuda_shaped, launched_as

from paratrain import JobConfig
from paratrain.env import ClusterEnv

CPU_BESIDE_NCCL = "cpu:gloo,cuda:nccl"


@pytest.fixture
def rank3_of_8(monkeypatch: pytest.MonkeyPatch) -> CudaShaped:
    """Rank 3 of a one-node, 8-GPU job."""
    launched_as(rank=3, local_rank=3, world_size=8, local_world_size=8)
    return cuda_shaped(monkeypatch, gpus=8)


def _parallel(strategy: str, env: ClusterEnv | None = None, **options):
    from paratrain import Parallel

    env = env or ClusterEnv(rank=3, local_rank=3, world_size=8, local_world_size=8, launched=True)
    return Parallel(strategy, accelerator="cuda", monitor=False, job=JobConfig(env=env), **options)


def test_parallel_makes_the_rank_gpu_current_before_its_group_and_first_collective(rank3_of_8: CudaShaped):
    par = _parallel("ddp")
    assert par.device == torch.device("cuda", 3)
    assert [g["current"] for g in rank3_of_8.groups] == [3]  # set before init_process_group
    assert rank3_of_8.groups[0]["device_id"] == torch.device("cuda", 3)
    assert rank3_of_8.object_calls and {current for _, current in rank3_of_8.object_calls} == {3}
    assert torch.cuda.current_device() == 3


def test_a_group_the_script_started_still_gets_the_rank_gpu(rank3_of_8: CudaShaped):
    """Ray Train (or the script) starts the group; the agreement's all_gather_object must not run on GPU 0."""
    from paratrain import Parallel

    dist.init_process_group("nccl")
    Parallel("ddp", accelerator="cuda", monitor=False)  # its env read as Ray Train leaves it: ranks only
    assert rank3_of_8.set_devices == [3]
    assert rank3_of_8.object_calls and {current for _, current in rank3_of_8.object_calls} == {3}


def test_a_script_group_that_cannot_carry_host_tensors_is_refused_in_one_line(rank3_of_8: CudaShaped):
    from paratrain import ConfigError, Parallel

    dist.init_process_group("nccl")
    with pytest.raises(ConfigError, match=r"serves no host tensors.*init_process_group\('cpu:gloo,cuda:nccl'\)"):
        Parallel("zero3", accelerator="cuda", monitor=False, cpu_offload=True)
    dist.destroy_process_group()
    dist.init_process_group("cpu:gloo,cuda:nccl")
    Parallel("zero3", accelerator="cuda", monitor=False, cpu_offload=True)


@pytest.mark.parametrize(
    ("strategy", "options", "backend"),
    [
        ("ddp", {}, "nccl"),
        ("zero3", {}, "nccl"),
        ("zero3", {"cpu_offload": True}, CPU_BESIDE_NCCL),  # clipping's norm and full state dicts reduce host shards
        ("zero2", {"cpu_offload": True}, CPU_BESIDE_NCCL),
        ("hsdp", {"cpu_offload": True}, CPU_BESIDE_NCCL),
    ],
)
def test_the_group_serves_the_host_tensors_the_strategy_sends(rank3_of_8: CudaShaped, strategy, options, backend):
    _parallel(strategy, **options)
    assert [g["backend"] for g in rank3_of_8.groups] == [backend]


def test_verify_claims_the_rank_gpu_and_serves_host_tensors(rank3_of_8: CudaShaped):
    """verify learns a case's options (cpu_offload among them) only after its group is up."""
    from paratrain.verify.distributed import run_cases

    assert run_cases([], timeout_s=5, accelerator="cuda") == []
    assert rank3_of_8.groups == [{"backend": CPU_BESIDE_NCCL, "device_id": None, "current": 3}]


def test_doctor_bandwidth_claims_the_rank_gpu(rank3_of_8: CudaShaped, monkeypatch: pytest.MonkeyPatch):
    from paratrain.doctor.bandwidth import sweep

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")  # read, never dialled: the fake group needs no store

    assert sweep([], "cuda", budget_s=1.0)[:2] == ("fake", "cuda")  # the backend it reports is the group's own
    assert rank3_of_8.groups == [{"backend": "nccl", "device_id": torch.device("cuda", 3), "current": 3}]


@pytest.mark.parametrize(("options", "backend"), [({}, "nccl"), ({"cpu_offload": True}, CPU_BESIDE_NCCL)])
def test_bench_job_claims_the_rank_gpu_with_its_runs_backend(rank3_of_8: CudaShaped, monkeypatch, options, backend):
    from paratrain.bench import measure
    from paratrain.bench.config import BenchConfig
    from paratrain.bench.runner import plan_jobs

    monkeypatch.setattr(measure, "_measure_all", lambda config, runs, device: {"device": device})
    config = BenchConfig(
        workload="mlp",
        nprocs=(1, 2),
        strategies=("ddp", "zero3"),
        accelerator="cuda",
        strategy_options={"zero3": options},
    )
    jobs, _, _ = plan_jobs(config, machine=_machine(gpus=8))
    assert measure.run_job(config, list(jobs[1].runs)) == {"device": torch.device("cuda", 3)}
    assert rank3_of_8.groups == [
        {"backend": backend, "device_id": torch.device("cuda", 3) if backend == "nccl" else None, "current": 3}
    ]


def _machine(gpus: int):
    from paratrain.bench.machine import Machine

    return Machine(cores=16, physical_cores=16, gpus=gpus)
