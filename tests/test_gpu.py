"""Checks that need CUDA (marker `gpu`; `pytest -m gpu` on a GPU machine). Each skips cleanly without CUDA.

Results on real hardware are recorded in docs/gpu-validation.md.
"""
import json
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from dist_workers import backend_and_device, train_params
from paratrain.testing import max_abs_diff, spawn

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def _on_cuda(strategy: str, world: int, **kwargs) -> dict:
    return train_params(strategy, 1, 20, 8, world, {}, accelerator="cuda", **kwargs)


def test_ddp_over_nccl_places_the_model_on_its_gpu_and_equals_serial():
    world = min(GPUS, 2)
    ranks = spawn(_on_cuda, world, ("ddp", world)) if world > 1 else [_on_cuda("ddp", 1)]
    serial = train_params("single", 1, 20, 8 * world, 1)  # CPU, fp32
    assert max_abs_diff(ranks[0], serial) <= 1e-4  # cuBLAS vs CPU kernels round differently


@pytest.mark.parametrize("precision, tolerance", [("bf16-mixed", 3e-3), ("fp16-mixed", 3e-3)])
def test_mixed_precision_on_cuda_stays_close_to_fp32(precision, tolerance):
    assert max_abs_diff(_on_cuda("single", 1, precision=precision), _on_cuda("single", 1)) <= tolerance


def test_nccl_backend_and_device_are_chosen_for_cuda():
    world = min(GPUS, 2)
    if world < 2:
        pytest.skip("needs 2 GPUs for a 2-process NCCL job")
    assert spawn(backend_and_device, world) == [("nccl", "cuda:0"), ("nccl", "cuda:1")]


@pytest.mark.skipif(GPUS < 2, reason="nn.DataParallel splits a batch only over 2+ GPUs")
def test_dataparallel_splits_over_gpus_and_equals_serial():
    assert max_abs_diff(_on_cuda("dp", 1), train_params("single", 1, 20, 8, 1)) <= 1e-4


@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="needs nvidia-smi")
def test_doctor_reads_the_real_nvidia_smi():
    res = subprocess.run([sys.executable, "-m", "paratrain", "doctor", "--json", "--skip-bandwidth"],
                         capture_output=True, text=True, timeout=60)
    report = json.loads(res.stdout)
    assert res.returncode in (0, 1), res.stderr
    assert any(c["name"] == "gpus" and c["status"] == "ok" for c in report["checks"]), report


def test_planner_memory_prediction_is_within_15_percent_of_max_memory_allocated():
    sys.path.insert(0, str(ROOT / "benchmarks"))  # the launched rank unpickles gpu_memory.run_case
    try:
        import gpu_memory

        case = gpu_memory.Case("gpt-52m", "single", "fp32", 2)
        result = gpu_memory.measure(case, 3, "cuda")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert result.get("measured"), result
    predicted = gpu_memory.predict(case)["allocated"]
    assert abs(predicted / result["measured"] - 1) <= 0.15, (predicted, result["measured"])
