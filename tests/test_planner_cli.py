"""``paratrain plan`` end to end: the table, JSON, and one-line errors for bad input."""
import json
import re
import subprocess

import pytest

from paratrain.cli.main import main


def test_plan_gpt2_medium_on_8_h100_recommends_ddp_or_a_zero_stage(paratrain_cmd):
    res = subprocess.run([*paratrain_cmd, "plan", "--model", "gpt2-medium", "--gpus", "8", "--gpu", "h100",
                          "--interconnect", "nvlink"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    for name in ("single", "ddp", "zero1", "zero2", "zero3", "pipeline", "model_parallel"):
        assert re.search(rf"^{name}\b", res.stdout, flags=re.M), name
    choice = re.search(r"^recommended: (\w+) ", res.stdout, flags=re.M).group(1)
    assert choice in ("ddp", "zero1", "zero2", "zero3")
    assert "LR: an LR tuned at another global batch than 64 wants scaling: --base-batch N" in res.stdout
    assert "scale it" not in res.stdout  # a script's LR may be tuned for its global batch already


def test_plan_json_has_the_per_gpu_breakdown_and_times(paratrain_cmd):
    res = subprocess.run([*paratrain_cmd, "plan", "--model", "llama-7b", "--gpus", "8", "--nodes", "2",
                          "--inter-node", "ib-ndr", "--base-batch", "8", "--json"], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)
    assert plan["model"]["params"] == 6_738_415_616
    for entry in plan["strategies"]:
        assert set(entry["memory_bytes"]) == {"parameters", "gradients", "optimizer_states", "activations",
                                              "transient", "buffers", "overhead", "total"}
        assert entry["memory_peak"] in ("backward", "optimizer step")
        assert {"compute_s", "bubble_s", "optimizer_s", "comm_s", "exposed_comm_s", "step_s"} <= set(entry["time"])
    assert plan["recommendation"]["fits"] and plan["recommendation"]["reason"]
    assert plan["lr_scaling"]["factor"] == 16


def test_breakdown_and_base_lr_in_process(capsys):
    assert main(["plan", "--model", "cnn", "--gpu", "l4", "--gpus", "2", "--breakdown", "--base-lr", "0.001",
                 "--base-batch", "8"]) == 0
    out = capsys.readouterr().out
    assert "params" in out and "optim" in out and "0.001 → 0.002" in out


@pytest.mark.parametrize("argv, message", [
    (["--model", "gpt2", "--gpu", "v100"], "unknown GPU 'v100'; choose one of: a100-40gb, a100-80gb, h100-80gb"),
    (["--model", "gpt2", "--batch", "-4"], "--batch must be >= 1, got -4"),
    (["--model", "gpt9"], "unknown model 'gpt9'; choose one of: mlp, cnn, gpt2"),
    (["--params", "70B", "--gpu", "l4", "--gpus", "1"], "no strategy fits: need "),
    (["--model", "gpt2", "--interconnect", "carrier-pigeon"], "unknown link 'carrier-pigeon'"),
    (["--model", "nosuchmodule:build", "--input", "4"], "cannot import 'nosuchmodule'"),
    (["--model", "gpt2", "--params", "1B"], "give --model or --params, not both"),
    (["--model", "gpt2", "--gpus", "0"], "--gpus must be >= 1, got 0"),
    (["--model", "gpt2", "--base-lr", "3e-4"], "--base-lr 0.0003 is scaled from the global batch it was tuned at; give "
     "that batch too (--base-batch N)"),
    (["--model", "gpt2", "--base-batch", "0"], "--base-batch must be >= 1, got 0"),
    (["--model", "gpt2", "--gpus", "8", "--dp", "8", "--global-batch", "4"],
     "--global-batch 4 does not split evenly over dp=8 replicas (0.5 samples each); use a multiple of 8, e.g. 8"),
    (["--model", "gpt2", "--gpus", "8", "--layout", "dp=2,pp=2,tp=2", "--global-batch", "6", "--micro-batches", "2"],
     "over dp=2 replicas x 2 micro-batches (1.5 samples each); use a multiple of 4, e.g. 4 or 8, or change"),
    (["--model", "gpt2", "--gpus", "8", "--nodes", "2", "--layout", "dp=8,pp=2,tp=2"],
     "the layout dp=8 x pp=2 x tp=2 needs 32 GPUs but the cluster has 16 (8 per node x 2 nodes); change the"),
    (["--model", "gpt2", "--gpus", "8", "--dp", "1", "--tp", "8"],
     "--tp 8: heads 12 does not divide by tp=8; use a degree that divides them: 1, 2, 4"),
    (["--model", "llama3-8b", "--gpus", "8", "--nodes", "2", "--tp", "16", "--dp", "1"],
     "key/value heads 8 does not divide by tp=16; use a degree that divides them: 1, 2, 4, 8"),
    (["--model", "gpt2", "--gpus", "8", "--nodes", "4", "--layout", "dp=1,pp=32"],
     "cuts the model into 32 pipeline stages but it has only 14 units to cut (its blocks, embedding and head); "
     "use --pp 14 or fewer"),
    (["--model", "gpt2", "--gpus", "8", "--layout", "dp=8,cp=2"], "--layout 'dp=8,cp=2': cannot read 'cp=2'"),
    (["--model", "gpt2", "--layout", "dp=1", "--pp", "2"], "give the layout once"),
    (["--model", "gpt2", "--kv-heads", "5"], "heads 12 is not divisible by kv_heads 5: each key/value head serves "
     "a whole group of query heads; give --kv-heads that divides --heads"),
    (["--model", "llama3-8b", "--heads", "30"], "hidden 4096 is not divisible by heads 30"),
    (["--model", "mlp", "--ffn-hidden", "64"], "shape transformers; 'mlp' is not one"),
    (["--model", "gpt2", "--model-config", "x.json"], "give --model or --model-config, not both"),
    (["--model-config", "pyproject.toml"], "--model-config pyproject.toml: not a transformers config.json"),
])
def test_bad_input_is_one_line(capsys, argv, message):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("paratrain: error: ") and message in err, err
    assert err.count("\n") == 1


def test_show_tp_plan_prints_the_plan_prepare_would_apply(capsys):
    """The model's own plan by default, the inferred one with 'auto'; nothing is planned or launched."""
    assert main(["plan", "--model", "gpt-tiny", "--tp", "2", "--show-tp-plan"]) == 0
    own = capsys.readouterr().out
    assert "# tp plan 'paratrain GPT' over tp=2 (sequence parallel)" in own
    assert "    'blocks.*.qkv': 'colwise(input=sequence)'," in own and "    'head': 'colwise'," in own
    assert main(["plan", "--model", "gpt-tiny", "--tp", "2", "--show-tp-plan", "auto"]) == 0
    inferred = capsys.readouterr().out
    assert "# tp_plan='auto' for GPT over tp=2" in inferred and "    'blocks.*.qkv': 'colwise'," in inferred
    assert "#   head -> colwise (vocabulary, logits left split for the loss; tied to wte)" in inferred
    assert "Memory" not in own + inferred and "recommend" not in (own + inferred).lower()


@pytest.mark.parametrize("argv, words", [
    (["--model", "gpt-tiny", "--show-tp-plan"], "--show-tp-plan needs --tp N"),
    (["--params", "1B", "--tp", "2", "--show-tp-plan"], "builds the model"),
])
def test_show_tp_plan_refuses_in_one_line(argv, words, capsys):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0]
