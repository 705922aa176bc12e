"""``paratrain plan`` end to end: the table, JSON, and one-line errors for bad input."""

import json
import re

import pytest
from helpers.cli import run_cli

from paratrain.cli.main import main


@pytest.mark.launched
def test_plan_gpt2_medium_on_8_h100_recommends_ddp_or_a_zero_stage(paratrain_cmd):
    res = run_cli(
        "plan", "--model", "gpt2-medium", "--gpus", "8", "--gpu", "h100", "--interconnect", "nvlink", timeout=60
    )
    assert res.returncode == 0, res.stderr
    for name in ("single", "ddp", "zero1", "zero2", "zero3", "pipeline", "model_parallel"):
        assert re.search(rf"^{name}\b", res.stdout, flags=re.M), name
    choice = re.search(r"^recommended: (\w+) ", res.stdout, flags=re.M).group(1)
    assert choice in ("ddp", "zero1", "zero2", "zero3")
    assert "LR: an LR tuned at another global batch than 64 wants scaling: --base-batch N" in res.stdout
    assert "scale it" not in res.stdout  # a script's LR may be tuned for its global batch already


@pytest.mark.launched
def test_plan_json_has_the_per_gpu_breakdown_and_times(paratrain_cmd):
    res = run_cli(
        "plan",
        "--model",
        "llama-7b",
        "--gpus",
        "8",
        "--nodes",
        "2",
        "--inter-node",
        "ib-ndr",
        "--base-batch",
        "8",
        "--json",
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)
    assert plan["model"]["params"] == 6_738_415_616
    for entry in plan["strategies"]:
        assert set(entry["memory_bytes"]) == {
            "parameters",
            "gradients",
            "optimizer_states",
            "activations",
            "transient",
            "buffers",
            "overhead",
            "total",
        }
        assert entry["memory_peak"] in ("backward", "optimizer step")
        assert {"compute_s", "bubble_s", "optimizer_s", "comm_s", "exposed_comm_s", "step_s"} <= set(entry["time"])
    assert plan["recommendation"]["fits"] and plan["recommendation"]["reason"]
    assert plan["lr_scaling"]["factor"] == 16


def test_breakdown_and_base_lr_in_process(capsys):
    assert (
        main(
            [
                "plan",
                "--model",
                "cnn",
                "--gpu",
                "l4",
                "--gpus",
                "2",
                "--breakdown",
                "--base-lr",
                "0.001",
                "--base-batch",
                "8",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "params" in out and "optim" in out and "0.001 → 0.002" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "gpt2", "--gpu", "v100"], "unknown GPU 'v100'; choose one of: a100-40gb, a100-80gb, h100-80gb"),
        (["--model", "gpt2", "--batch", "-4"], "--batch must be >= 1, got -4"),
        (["--model", "gpt9"], "unknown model 'gpt9'; choose one of: mlp, cnn, gpt2"),
        (["--params", "70B", "--gpu", "l4", "--gpus", "1"], "no strategy fits: need "),
        (["--model", "gpt2", "--interconnect", "carrier-pigeon"], "unknown link 'carrier-pigeon'"),
        (["--model", "nosuchmodule:build", "--input", "4"], "cannot import 'nosuchmodule'"),
        (["--model", "gpt2", "--params", "1B"], "give --model or --params, not both"),
        (["--model", "gpt2", "--gpus", "0"], "--gpus must be >= 1, got 0"),
        (
            ["--model", "gpt2", "--base-lr", "3e-4"],
            "--base-lr 0.0003 is scaled from the global batch it was tuned at; give that batch too (--base-batch N)",
        ),
        (["--model", "gpt2", "--base-batch", "0"], "--base-batch must be >= 1, got 0"),
        (
            ["--model", "gpt2", "--gpus", "8", "--dp", "8", "--global-batch", "4"],
            "--global-batch 4 does not split evenly over dp=8 replicas (0.5 samples each); use a multiple of 8, e.g. 8",
        ),
        (
            [
                "--model",
                "gpt2",
                "--gpus",
                "8",
                "--layout",
                "dp=2,pp=2,tp=2",
                "--global-batch",
                "6",
                "--micro-batches",
                "2",
            ],
            "over dp=2 replicas x 2 micro-batches (1.5 samples each); use a multiple of 4, e.g. 4 or 8, or change",
        ),
        (
            ["--model", "gpt2", "--gpus", "8", "--nodes", "2", "--layout", "dp=8,pp=2,tp=2"],
            "the layout dp=8 x pp=2 x tp=2 needs 32 GPUs but the cluster has 16 (8 per node x 2 nodes); change the",
        ),
        (
            ["--model", "gpt2", "--gpus", "8", "--dp", "1", "--tp", "8"],
            "--tp 8: heads 12 does not divide by tp=8; use a degree that divides them: 1, 2, 4",
        ),
        (
            ["--model", "llama3-8b", "--gpus", "8", "--nodes", "2", "--tp", "16", "--dp", "1"],
            "key/value heads 8 does not divide by tp=16; use a degree that divides them: 1, 2, 4, 8",
        ),
        (
            ["--model", "gpt2", "--gpus", "8", "--nodes", "4", "--layout", "dp=1,pp=32"],
            "--pp 32 cuts gpt2 into 32 pipeline stages but paratrain's pipelines cut it into 12 at most; "
            "use --pp 12 or fewer",
        ),
        (["--model", "gpt2", "--gpus", "8", "--layout", "dp=8,sp=2"], "--layout 'dp=8,sp=2': cannot read 'sp=2'"),
        (["--model", "gpt2", "--layout", "dp=1", "--pp", "2"], "give the layout once"),
        (
            ["--model", "gpt2", "--kv-heads", "5"],
            "heads 12 is not divisible by kv_heads 5: each key/value head serves "
            "a whole group of query heads; give --kv-heads that divides --heads",
        ),
        (["--model", "llama3-8b", "--heads", "30"], "hidden 4096 is not divisible by heads 30"),
        (["--model", "mlp", "--ffn-hidden", "64"], "shape transformers; 'mlp' is not one"),
        (["--model", "gpt2", "--model-config", "x.json"], "give --model or --model-config, not both"),
        (["--model-config", "pyproject.toml"], "--model-config pyproject.toml: not a transformers config.json"),
    ],
)
def test_bad_input_is_one_line(capsys, argv, message):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("paratrain: error: ") and message in err, err
    assert err.count("\n") == 1


def test_tp_plan_prints_the_plan_prepare_would_apply(capsys):
    """The model's own plan by default, the inferred one with --auto; nothing is planned or launched."""
    assert main(["tp-plan", "--model", "gpt-tiny", "--tp", "2"]) == 0
    own = capsys.readouterr().out
    assert "# tp plan 'paratrain GPT' over tp=2 (sequence parallel)" in own
    assert "    'blocks.*.qkv': 'colwise(input=sequence)'," in own and "    'head': 'colwise'," in own
    assert main(["tp-plan", "--model", "gpt-tiny", "--tp", "2", "--auto"]) == 0
    inferred = capsys.readouterr().out
    assert "# tp_plan='auto' for GPT over tp=2" in inferred and "    'blocks.*.qkv': 'colwise'," in inferred
    assert "#   head -> colwise (vocabulary, logits left split for the loss; tied to wte)" in inferred
    assert "Memory" not in own + inferred and "recommend" not in (own + inferred).lower()


@pytest.mark.parametrize(
    "argv, words",
    [
        (["tp-plan", "--model", "gpt-tiny"], "tp-plan needs --tp N (N >= 2)"),
        (
            ["tp-plan", "--model", "gpt-tiny", "--tp", "1"],
            "needs --tp N (N >= 2): the plan depends on the degree; got --tp 1",
        ),
        (["tp-plan", "--params", "1B", "--tp", "2"], "builds the model"),
        (["tp-plan", "--model", "gpt-tiny", "--tp", "2", "--layers", "0"], "--layers must be >= 1, got 0"),
        (["tp-plan", "--model", "gpt-tiny", "--tp", "2", "--gpus", "8"], "unrecognized arguments: --gpus 8"),
        (["dry-run", "--model", "gpt-tiny"], "the following arguments are required: --world"),
        (["dry-run", "--model", "gpt-tiny", "--world", "0"], "--world must be >= 1, got 0"),
        (["dry-run", "--model", "gpt-tiny", "--world", "8", "--per-node", "0"], "--per-node must be >= 1, got 0"),
        (["dry-run", "--model", "gpt-tiny", "--world", "8", "--tp", "0"], "--tp must be >= 1, got 0"),
        (["dry-run", "--model", "gpt-tiny", "--world", "8", "--strategy", "nope"], "unknown strategy 'nope'"),
        (["dry-run", "--model", "gpt-tiny", "--world", "8", "--optimizer", "lion"], "invalid choice: 'lion'"),
        (
            ["dry-run", "--model", "gpt-tiny", "--model-config", "x.json", "--world", "8"],
            "give --model or --model-config",
        ),
        (["dry-run", "--world", "8"], "a dry run builds the model: give --model"),
        (["dry-run", "--model", "gpt-tiny", "--world", "8", "--gpus", "8"], "unrecognized arguments: --gpus 8"),
        (["plan", "--model", "gpt2", "--world", "8"], "--world is `paratrain dry-run`'s"),
        (["plan", "--model", "gpt2", "--mfu", "0"], "--mfu must be > 0, got 0"),
        (["plan", "--model", "gpt2", "--mfu", "1.5"], "--mfu is a fraction of peak, at most 1, got 1.5"),
        (["plan", "--model", "gpt2", "--nodes", "0"], "--nodes must be >= 1, got 0"),
        (["plan", "--model", "gpt2", "--ps-servers", "-1"], "--ps-servers must be >= 0, got -1"),
        (
            ["plan", "--model", "gpt2", "--checkpointing", "--recompute", "op"],
            "give one of --checkpointing or --recompute op",
        ),
    ],
)
def test_each_bad_flag_of_tp_plan_dry_run_and_plan_is_one_line(argv, words, capsys):
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own refusals
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


def test_the_old_spellings_run_the_new_commands_with_one_line_naming_them(capsys):
    assert main(["plan", "--model", "gpt-tiny", "--tp", "2", "--show-tp-plan", "auto"]) == 0
    out = capsys.readouterr()
    assert out.err == "paratrain: deprecated: `paratrain plan --show-tp-plan auto` is now `paratrain tp-plan --auto`\n"
    assert "# tp_plan='auto' for GPT over tp=2" in out.out
    assert (
        main(
            ["plan", "--dry-run", "--model", "gpt-tiny", "--gpus", "2", "--nodes", "2", "--strategy", "zero3", "--json"]
        )
        == 0
    )
    out = capsys.readouterr()
    assert out.err.startswith("paratrain: deprecated: `paratrain plan --dry-run` is now `paratrain dry-run`")
    assert out.err.count("\n") == 1 and json.loads(out.out)["world"] == 4  # --gpus x --nodes
    assert main(["plan", "--dry-run", "--model", "gpt-tiny", "--world", "0"]) == 2  # not a world of 1, as it was
    assert capsys.readouterr().err.splitlines()[1] == "paratrain: error: --world must be >= 1, got 0"
    assert main(["plan", "--model", "gpt-tiny", "--show-tp-plan"]) == 2
    assert "tp-plan needs --tp N" in capsys.readouterr().err.splitlines()[1]
