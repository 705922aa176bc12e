"""Checks that need CUDA (marker `gpu`; `pytest -m gpu` on a GPU machine). Each skips cleanly without CUDA.

Results on real hardware are recorded in benchmarks/GPU-LOG.md. With one GPU, jobs run one process per GPU
(NCCL refuses two ranks on one device), so the multi-rank NCCL checks need 2+ GPUs and skip otherwise.
"""

import json
import shutil
import sys
from functools import partial

import pytest
import torch
from helpers.cli import run_cli
from helpers.dist_workers import backend_and_device, train_params
from helpers.paths import ROOT

from paratrain.testing import max_abs_diff, spawn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.launched,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
WORLD = min(GPUS, 2)


def _on_cuda(strategy: str, world: int, **kwargs) -> dict:
    return train_params(strategy, 1, 20, 8, world, {}, accelerator="cuda", **kwargs)


def _launched(strategy: str, **kwargs) -> dict:
    """``strategy`` trained by WORLD launched NCCL processes, one GPU each; rank 0's full state."""
    fn = partial(train_params, accelerator="cuda", **kwargs)
    return spawn(fn, WORLD, (strategy, 1, 20, 8, WORLD, {}))[0]


def test_ddp_over_nccl_places_the_model_on_its_gpu_and_equals_serial():
    serial = train_params("single", 1, 20, 8 * WORLD, 1)  # CPU, fp32
    assert max_abs_diff(_launched("ddp"), serial) <= 1e-4  # cuBLAS vs CPU kernels round differently


def test_nccl_backend_and_device_are_chosen_for_cuda():
    assert spawn(backend_and_device, WORLD) == [("nccl", f"cuda:{r}") for r in range(WORLD)]


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3", "model_parallel"])
def test_every_data_parallel_strategy_on_nccl_equals_single_on_cuda(strategy):
    single = _on_cuda("single", 1) if WORLD == 1 else train_params("single", 1, 20, 8 * WORLD, 1, accelerator="cuda")
    assert max_abs_diff(_launched(strategy), single) <= 1e-5


def test_a_plain_process_runs_ddp_on_a_private_nccl_group():
    """`python train.py` with strategy='ddp' on a GPU: a one-rank NCCL group, same math as 'single'."""
    assert max_abs_diff(_on_cuda("ddp", 1), _on_cuda("single", 1)) <= 1e-6


@pytest.mark.parametrize("precision, tolerance", [("bf16-mixed", 3e-3), ("fp16-mixed", 3e-3)])
def test_mixed_precision_on_cuda_stays_close_to_fp32(precision, tolerance):
    assert max_abs_diff(_on_cuda("single", 1, precision=precision), _on_cuda("single", 1)) <= tolerance


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_fsdp_mixed_precision_on_nccl_stays_close_to_fp32(precision):
    assert max_abs_diff(_launched("zero3", precision=precision), _launched("zero3")) <= 3e-3


def test_fp16_mixed_scales_the_loss_and_skips_steps_with_inf_gradients():
    import paratrain

    par = paratrain.Parallel("single", precision="fp16-mixed", accelerator="cuda")
    model = torch.nn.Linear(4, 1)
    model, opt = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert par.precision.scaler is not None and par.precision.scaler.get_scale() > 1
    before = model.weight.detach().clone()
    with par.step(model, opt):
        par.backward(model(torch.full((2, 4), float("inf"), device=par.device)).sum())
    assert torch.equal(model.weight, before)  # the inf step was skipped
    assert par.precision.scaler.get_scale() < 2.0**16  # and the scale backed off
    par.close()


@pytest.mark.parametrize("case", ["nanogpt", "sparse"])
def test_ps_workers_on_cuda_with_a_server_in_host_memory_equal_one_process(tmp_path, case):
    """`Parallel("ps")` on a GPU machine: worker rank 0 trains on cuda:0, the server keeps its shards (and the
    tables) in host memory, messages travel as host tensors over gloo beside NCCL; sync mode equals one process."""
    from helpers.ps_workers import run_sparse, run_zoo, sparse_reference, zoo_reference

    options = {"servers": 1, "accelerator": "cuda"}
    if case == "sparse":
        got = spawn(run_sparse, 2, ("sgd", {**options, "tables": ["bag", "emb"]}, str(tmp_path)), timeout_s=180)
        expected = sparse_reference("sgd", 1)
    else:
        got = spawn(run_zoo, 2, (case, options), timeout_s=180)
        expected = zoo_reference(case, 1)
    assert got[1] is None  # the server ended its process cleanly
    assert max_abs_diff(got[0]["state"], expected) <= 1e-4  # cuBLAS vs CPU kernels


@pytest.mark.skipif(GPUS < 2, reason="nn.DataParallel splits a batch only over 2+ GPUs")
def test_dataparallel_splits_over_gpus_and_equals_serial():
    assert max_abs_diff(_on_cuda("dp", 1), train_params("single", 1, 20, 8, 1)) <= 1e-4


@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="needs nvidia-smi")
def test_doctor_reads_the_real_nvidia_smi():
    res = run_cli("doctor", "--json", "--skip-bandwidth", timeout=60)
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


@pytest.mark.parametrize("strategy", ["single", "ddp", "zero3"])
def test_resume_on_cuda_is_bitwise_exact_with_cuda_rng(tmp_path, strategy):
    """Dropout draws from the CUDA generator: a resume is exact only if its state was saved and restored."""
    from helpers.checkpoint_workers import train

    options = {"accelerator": "cuda"}
    whole = train(strategy, 18, str(tmp_path), save_at=7, options=options)
    resumed = train(strategy, 18, str(tmp_path), load=True, options=options)
    assert resumed["resumed_at"][0] == 7
    assert all(torch.equal(whole["params"][k], resumed["params"][k]) for k in whole["params"])


def test_the_demo_is_bitwise_repeatable_on_cuda_and_ddp_equals_single(paratrain_cmd):
    """The demo's deterministic kernels: two runs, and ddp against single, end with the same SHA-256."""

    def digest(strategy: str) -> str:
        res = run_cli("demo", "-n", "1", "--strategy", strategy, "--epochs", "2", timeout=180)
        assert res.returncode == 0, res.stderr[-2000:]
        return res.stdout.split("final parameters sha256 ")[1].split()[0]

    first = digest("single")
    assert digest("single") == first
    assert digest("ddp") == first


def test_plan_measure_on_this_gpu_calibrates_its_compute_from_real_steps():
    from paratrain.errors import ConfigError
    from paratrain.planner import PlanConfig, Training, make_plan
    from paratrain.planner.gpu_step import check_same_gpu
    from paratrain.planner.hardware import DEVICES
    from paratrain.workloads.model_names import resolve_model

    name = torch.cuda.get_device_name()
    here = []
    for device in DEVICES.values():
        try:
            check_same_gpu(device, name)
            here.append(device.name)
        except ConfigError:
            pass
    if not here:
        pytest.skip(f"{name} is not in the planner's catalogue")
    plain = make_plan(resolve_model("gpt2"), PlanConfig(gpu=here[0], training=Training(micro_batch=2)))
    plan = make_plan(resolve_model("gpt2"), PlanConfig(gpu=here[0], training=Training(micro_batch=2), measure=True))
    assert plan.cluster.device.mfu != plain.cluster.device.mfu and 0 < plan.cluster.device.mfu <= 1
    assert plan.cluster.device.memory_gbs != plain.cluster.device.memory_gbs
    assert any(f"measured on this machine's {name} at batch 2" in n for n in plan.notes), plan.notes
