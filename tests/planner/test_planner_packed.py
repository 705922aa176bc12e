"""Packed rows (``--document-tokens L``): a row of S tokens in documents of L computes S·L of attention, not S², in
the closed forms, in a trace and on context-parallel ranks; without L, or with L >= S, the plan is today's."""

import json
from dataclasses import replace

import pytest
import torch

from paratrain.cli.main import main
from paratrain.errors import ConfigError
from paratrain.planner import InputSpec, PlanConfig, RunnableModel, Training, TrainingCall, make_plan
from paratrain.planner.report import plan_to_json
from paratrain.planner.timing import executed_flops_per_sample
from paratrain.planner.transformer import transformer_stats
from paratrain.workloads.gpt import GPT, GPT_CONFIGS, GPTConfig

LLAMA = replace(GPT_CONFIGS["llama-7b"], seq_len=4096)


def _plan(documents: int | None, gpus: int = 8, **config):
    stats = transformer_stats(LLAMA, name="llama-7b")
    return make_plan(stats, PlanConfig(gpus=gpus, training=Training(document_tokens=documents), **config))


def test_documents_of_an_eighth_of_the_row_cut_attention_to_an_eighth():
    whole, packed = _plan(None), _plan(512)
    attention = whole.stats.attention_flops_per_sample
    assert packed.stats.attention_flops_per_sample == attention / 8
    cut = attention - packed.stats.attention_flops_per_sample
    assert packed.stats.flops_per_sample == whole.stats.flops_per_sample - cut
    # a causal kernel runs half of the attention either way: the step runs half the cut less
    assert executed_flops_per_sample(packed.stats, packed.training) == pytest.approx(
        executed_flops_per_sample(whole.stats, whole.training) - cut / 2, rel=1e-12
    )
    for w, p in zip(whole.estimates, packed.estimates, strict=True):
        assert p.name == w.name and p.memory == w.memory  # the fused kernels keep nothing s x s
        assert p.time.compute_s < w.time.compute_s


@pytest.mark.parametrize("documents", [4096, 8192])
def test_without_documents_or_documents_as_long_as_the_row_the_plan_is_todays(documents):
    today = plan_to_json(_plan(None))
    same = plan_to_json(_plan(documents))
    assert same["training"].pop("document_tokens") == documents
    today["training"].pop("document_tokens")
    assert same == today


@pytest.mark.parametrize("documents", [0, -512, 2.5, True])
def test_a_bad_document_length_is_one_line(documents):
    with pytest.raises(ConfigError, match=r"^--document-tokens is the tokens of a packed row's documents, a whole "):
        Training(document_tokens=documents)


def test_measuring_unpacked_rows_is_refused_with_documents():
    with pytest.raises(ConfigError, match="--measure times unpacked rows; with --document-tokens give --step-time"):
        PlanConfig(measure=True, training=Training(document_tokens=512))


def test_the_flag_reaches_the_planner_as_text_and_json(capsys):
    args = ["plan", "--model", "llama-7b", "--seq-len", "4096", "--gpus", "8", "--document-tokens", "512"]
    assert main([*args, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["training"]["document_tokens"] == 512
    assert plan["model"]["flops_per_sample"] == _plan(512).stats.flops_per_sample < _plan(None).stats.flops_per_sample
    assert main(args) == 0
    assert "micro-batch 8 per GPU, global batch 64, rows packed with documents of 512 tokens" in capsys.readouterr().out
    assert main([*args[:-1], "0"]) != 0
    err = capsys.readouterr().err.strip()
    assert err.endswith("--document-tokens is the tokens of a packed row's documents, a whole number >= 1; got 0")
    assert len(err.splitlines()) == 1


def test_a_traced_models_attention_is_counted_per_document():
    """A module:factory model traced on the meta device: each attention call's FLOPs scaled, the cut the closed
    forms' for its shape (its attention FLOPs are the closed forms')."""
    cfg = GPTConfig(layers=2, hidden=64, heads=4, seq_len=256, vocab=128, bias=False)
    model = RunnableModel(
        name="gpt", factory=lambda: GPT(cfg), call=TrainingCall(input=InputSpec(shape=(256,), dtype=torch.long))
    )
    whole, packed = (make_plan(model, PlanConfig(gpu="cpu", training=Training(document_tokens=d))) for d in (None, 32))
    assert "traced" in packed.stats.source and not packed.stats.attention_flops_per_sample
    cut = transformer_stats(cfg, name="gpt").attention_flops_per_sample * (1 - 32 / 256)
    assert packed.stats.flops_per_sample == pytest.approx(whole.stats.flops_per_sample - cut, rel=1e-12)
    assert sum(packed.stats.unit_flops) == pytest.approx(packed.stats.flops_per_sample, rel=1e-12)


def test_context_parallel_ranks_exchange_as_many_bytes_and_compute_fewer_flops():
    whole, packed = (_plan(d, layout="zero3,cp=2", gpus=2) for d in (None, 512))
    pairs = [(w, p) for w, p in zip(whole.estimates, packed.estimates, strict=True) if w.layout.cp == 2]
    assert pairs
    for w, p in pairs:
        assert p.time.cp_comm_s == w.time.cp_comm_s > 0 and p.memory == w.memory
        assert p.time.compute_s < w.time.compute_s
