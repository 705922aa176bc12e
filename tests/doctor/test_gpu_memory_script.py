"""benchmarks/gpu_memory.py without a GPU: its predictions and case list, and one case run for real on the CPU
(a one-rank gloo group under zero3 with bf16 mixed precision), so the GPU run does not find a broken script."""

import json
import sys

import pytest
from helpers.paths import ROOT


@pytest.fixture(scope="module")
def gpu_memory():
    sys.path.insert(0, str(ROOT / "benchmarks"))  # spawned ranks inherit it and unpickle gpu_memory.run_case
    try:
        import gpu_memory

        yield gpu_memory
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_dry_run_prints_every_prediction_and_writes_json(gpu_memory, tmp_path, capsys):
    out = tmp_path / "gpu_memory.json"
    assert gpu_memory.main(["--dry-run", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 4 * 2 * 4  # models x batch sizes x (single, zero3) x (fp32, bf16-mixed)
    assert {r["predicted_phase"] for r in rows} == {"backward", "optimizer step"}
    for r in rows:
        assert r["measured_bytes"] is None and r["predicted_bytes"] > 0
        assert f"{r['model']} {r['strategy']} {r['precision']} b{r['batch']}" in printed
    mlp = [r for r in rows if r["model"] == "mlp-100m" and r["precision"] == "fp32" and r["strategy"] == "single"]
    assert mlp[0]["predicted_bytes"] == pytest.approx(20 * mlp[0]["params"], rel=0.01)  # p, g, Adam, sqrt(v) temp


@pytest.mark.launched
def test_a_zero3_bf16_case_runs_on_one_cpu_rank(gpu_memory):
    case = gpu_memory.Case("gpt-tiny", "zero3", "bf16-mixed", 2)
    assert gpu_memory.measure(case, 2, "cpu") == {"measured": None}  # ran; no allocator peak on a CPU


def test_without_cuda_it_says_how_to_run(gpu_memory, capsys):
    if gpu_memory.torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(SystemExit):
        gpu_memory.main([])
    assert "no CUDA device" in capsys.readouterr().err
