"""The planner calls a model as training does (planner/inputs.py): with its targets, taking its own loss, and says so
when what it traced is not per token; attention as the fused kernel runs it (planner/attention.py)."""

import json
from dataclasses import replace

import pytest
import torch
from helpers.nanogpt_shaped import gpt2, tiny
from torch import nn
from torch.nn import functional as F

from paratrain.cli.main import main
from paratrain.errors import ConfigError
from paratrain.planner import (
    InputSpec,
    TrainingCall,
    measure_module,
    trace_module,
    transformer_stats,
)
from paratrain.planner.inputs import target_parameter
from paratrain.workloads.gpt import GPT_CONFIGS

TOKENS = InputSpec.parse("long:1024")


def test_nanogpt_traced_with_targets_has_the_closed_forms_flops_and_activations():
    """nanoGPT's ``model(x)`` computes the last position's logits only: 27% of the FLOPs and 26% of the activations
    short of training at 124M parameters. Given targets (found by name), its trace is the training step's."""
    closed = transformer_stats(replace(GPT_CONFIGS["gpt2"], vocab=50304), name="gpt2")
    trained = trace_module(gpt2, TOKENS, name="nanogpt")
    assert trained.flops_per_sample == pytest.approx(closed.flops_per_sample, rel=0.002)
    assert trained.activation_bytes_per_sample == pytest.approx(closed.activation_bytes_per_sample, rel=0.002)
    assert trained.output_bytes_per_sample == closed.output_bytes_per_sample and not trained.warnings
    inference = trace_module(gpt2, TrainingCall(input=TOKENS, plain=True), name="nanogpt")
    assert inference.flops_per_sample / closed.flops_per_sample == pytest.approx(0.73, abs=0.01)
    assert inference.activation_bytes_per_sample / closed.activation_bytes_per_sample == pytest.approx(0.74, abs=0.01)
    (warning,) = inference.warnings
    assert warning.startswith("nanogpt's traced output has 1 position a sample for 1024 input tokens: not per token")


def test_a_traced_model_equals_what_it_saves_and_computes_on_this_cpu():
    """The meta trace (the fused attention kernel, the model's own loss) against a real CPU step: same activations,
    same FLOPs; torch's fused CPU kernel's FLOPs are counted too."""
    call = TrainingCall(input=InputSpec.parse("long:64"))
    traced = trace_module(tiny, call, name="tiny", batch=2)
    measured = measure_module(tiny, call, name="tiny", batch=2, steps=1)
    assert measured.activation_bytes_per_sample == pytest.approx(traced.activation_bytes_per_sample, rel=0.01)
    assert measured.flops_per_sample == traced.flops_per_sample > 0


def test_transformers_labels_and_a_classifiers_y_are_found_and_their_loss_taken():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    lm = lambda: transformers.GPT2LMHeadModel(cfg)  # noqa: E731
    assert target_parameter(lm()) == "labels"
    with_labels = trace_module(lm, InputSpec.parse("long:16"), name="gpt2")
    plain = trace_module(lm, TrainingCall(input=InputSpec.parse("long:16"), plain=True), name="gpt2")
    assert with_labels.output_bytes_per_sample == plain.output_bytes_per_sample == 4 * 16 * 128  # the logits
    assert with_labels.flops_per_sample == pytest.approx(plain.flops_per_sample, rel=0.01)

    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head = nn.Linear(8, 16), nn.Linear(16, 3)

        def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
            logits = self.head(self.body(x).relu())
            return logits if y is None else F.cross_entropy(logits, y)

    stats = trace_module(Classifier, InputSpec.parse("8"), name="classifier")  # y: one class id a sample
    plain = trace_module(Classifier, TrainingCall(input=InputSpec.parse("8"), plain=True), name="classifier")
    assert stats.flops_per_sample == plain.flops_per_sample and not stats.warnings
    with pytest.raises(ConfigError, match=r"--targets: Linear.forward takes no targets .*; drop --targets"):
        trace_module(
            lambda: nn.Linear(4, 2),
            TrainingCall(input=InputSpec.parse("4"), targets=InputSpec.parse("long")),
            name="linear",
        )


def test_input_specs_read_one_value_a_sample():
    assert InputSpec.parse("long") == InputSpec(shape=(), dtype=torch.long)
    assert TrainingCall.parse(TOKENS, "none").plain and TrainingCall.parse(TOKENS, "long:1024").targets == TOKENS
    with pytest.raises(ConfigError, match="unknown input dtype 'cheese'"):
        InputSpec.parse("cheese:4")


@pytest.mark.slow
def test_plan_traces_nanogpt_as_training_and_gives_no_lr_advice_unasked(capsys):
    """nanoGPT's own run: 480 samples a step, 12 a GPU, on 8 GPUs; its LR is tuned for that batch already."""
    argv = [
        "plan",
        "--model",
        "helpers.nanogpt_shaped:gpt2",
        "--input",
        "long:1024",
        "--gpu",
        "a100-80gb",
        "--gpus",
        "8",
        "--batch",
        "12",
        "--global-batch",
        "480",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "per sample 875 GFLOP forward+backward" in out and "warning" not in out and "scale it" not in out
    assert main([*argv, "--targets", "none", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["model"]["warnings"][0].startswith("helpers.nanogpt_shaped:gpt2's traced output has 1 position")
    assert plan["lr_scaling"] is None
    assert max(s["efficiency"] for s in plan["strategies"]) <= 1.0
