"""strategy='auto': ddp while the model states fit, then the least ZeRO sharding that fits."""
import pytest
from torch import nn

from paratrain.planner.auto import choose
from paratrain.planner.hardware import make_cluster


def _big() -> nn.Module:  # 100M parameters on the meta device: nothing allocated
    return nn.Sequential(*[nn.Linear(5000, 5000, device="meta") for _ in range(4)])


@pytest.mark.parametrize("gpu_mem_gb, strategy", [(4, "ddp"), (2.2, "zero1"), (1.5, "zero2"), (0.5, "zero3")])
def test_auto_prefers_ddp_and_shards_only_as_much_as_needed(gpu_mem_gb, strategy):
    choice = choose(_big(), make_cluster("h100", gpus=8, gpu_mem_gb=gpu_mem_gb), "fp32")
    assert choice.strategy == strategy
    assert "100.0M parameters" in choice.reason or "nothing fits" in choice.reason


def test_demo_prints_the_auto_choice(paratrain_cmd):
    import subprocess

    res = subprocess.run([*paratrain_cmd, "demo", "-n", "2", "--epochs", "1"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("strategy 'auto' chose ddp") == 1  # once, on rank 0
    assert "several processes are usually slower" in res.stdout
