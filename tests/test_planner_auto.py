"""strategy='auto': ddp while the model states fit, then the least ZeRO sharding that fits."""
from dataclasses import replace

import pytest
from torch import nn

from paratrain.planner.auto import choose, processes_vs_threads
from paratrain.planner.hardware import cpu_host, make_cluster


def _big() -> nn.Module:  # 100M parameters on the meta device: nothing allocated
    return nn.Sequential(*[nn.Linear(5000, 5000, device="meta") for _ in range(4)])


@pytest.mark.parametrize("gpu_mem_gb, strategy", [(4, "ddp"), (2.2, "zero1"), (1.5, "zero2"), (0.5, "zero3")])
def test_auto_prefers_ddp_and_shards_only_as_much_as_needed(gpu_mem_gb, strategy):
    choice = choose(_big(), make_cluster("h100", gpus=8, gpu_mem_gb=gpu_mem_gb), "fp32")
    assert choice.strategy == strategy
    assert "100.0M parameters" in choice.reason or "nothing fits" in choice.reason


def test_on_a_cpu_host_auto_weighs_processes_against_threads():
    cluster = replace(make_cluster("cpu", gpus=4), device=cpu_host(cores=2))
    note = processes_vs_threads(_mlp(), cluster, "fp32", "ddp")
    assert note.startswith("4 processes on 2 cores time-share them")
    extra_ms = float(note.split("each step takes ")[1].split(" ms")[0])
    assert extra_ms > 0 and "More processes will be slower here than threads" in note


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 10))


def test_demo_prints_the_auto_choice(paratrain_cmd):
    import subprocess

    res = subprocess.run([*paratrain_cmd, "demo", "-n", "2", "--epochs", "1"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("strategy 'auto' chose ddp") == 1  # once, on rank 0
    assert "2 processes on 2 cores" in res.stdout or "cores split them" in res.stdout
    assert "More processes will be slower here than threads" in res.stdout
