"""``paratrain plan --tp/--cp`` on a model the planner traces (a user's ``module:factory``): tp and cp rows where the
runtime splits it, counted from the runtime's own decision (the tp plan ``prepare`` applies, cp's attention found by
its kernel call), none where the runtime refuses, with the runtime's line (``strategies.split_shapes``)."""

from __future__ import annotations

import functools

import pytest
from helpers import shapes
from helpers.nanogpt_shaped import tiny

from paratrain.errors import ConfigError
from paratrain.planner import ModelSpec, Plan, PlanConfig, make_plan
from paratrain.planner.model_stats import RunnableModel
from paratrain.planner.tensor_parallel import rank_activations, rank_params
from paratrain.workloads.model_names import resolve_model

NANOGPT = "helpers.nanogpt_shaped:tiny"  # 2 blocks of 64 wide, 4 heads, vocabulary 512, 64 tokens
TITAN = "helpers.shapes:titan_llama"  # 2 blocks of 32 wide, 4 heads, 2 key/value heads, 16 tokens


@functools.cache
def stats_of(model: str, tokens: int, tp: int | None = None, cp: int | None = None):
    runnable = resolve_model(ModelSpec(model=model, input_spec=f"long:{tokens}"))
    assert isinstance(runnable, RunnableModel) and runnable.stats is None  # traced, no closed forms
    return runnable.find_stats(tp=tp, cp=cp)


@functools.cache
def rows(model: str, tokens: int, **config) -> tuple[Plan, set[tuple[int, int]]]:
    """The plan of ``model`` on ``tokens``-token samples, and its (tp, cp) degrees."""
    plan = make_plan(resolve_model(ModelSpec(model=model, input_spec=f"long:{tokens}")), PlanConfig(**config))
    return plan, {(e.layout.tp, e.layout.cp) for e in plan.estimates}


@pytest.mark.slow
def test_nanogpt_gets_tp_rows_counting_what_the_inferred_plan_splits():
    """The runtime's plan for nanoGPT splits the MLPs and the tied vocabulary; attention stays whole (its forward
    reads the head size from the input's width): exactly those parameters are split, activations counted whole."""
    stats = stats_of(NANOGPT, 64)
    model = tiny()
    mlp = sum(
        b.mlp.c_fc.weight.numel() + b.mlp.c_fc.bias.numel() + b.mlp.c_proj.weight.numel() for b in model.transformer.h
    )
    vocab = model.lm_head.weight.numel()  # tied: split once, in the embedding's unit
    assert dict(zip((u for u, _ in stats.units), stats.tp.split)) == {
        "transformer.wte": vocab,
        "transformer.wpe": 0,
        "transformer.drop": 0,
        "transformer.h.0": mlp // 2,
        "transformer.h.1": mlp // 2,
        "transformer.ln_f": 0,
        "lm_head": 0,
    }
    assert rank_params(stats, 2) == stats.params - (mlp + vocab) // 2
    assert (stats.tp.layers, stats.tp.hidden, stats.tp.seq_len) == (2, 64, 64)
    assert not stats.tp.sequence_parallel and not stats.tp.splits_activations
    figures = (1000.0, 100.0, 10.0)
    assert rank_activations(stats, figures, "fp32", 2) == figures
    plan, found = rows(NANOGPT, 64, gpus=4, gpu="h100")
    assert {t for t, _ in found} == {1, 2, 4}
    assert {e.layout.name for e in plan.estimates if e.layout.tp == 2} >= {"ddp", "zero3"}


def test_nanogpt_gets_no_cp_rows_the_runtime_refuses_them_for_want_of_positions():
    stats = stats_of(NANOGPT, 64)
    assert stats.cp is None and "GPT.forward takes neither" in stats.refused["cp"]
    plan, found = rows(NANOGPT, 64, gpus=4, gpu="h100")
    assert {c for _, c in found} == {1}
    assert any(n.startswith("no cp rows: the runtime refuses cp on this model (cp hands each rank") for n in plan.notes)
    with pytest.raises(
        ConfigError, match=r"^--cp for 'helpers.nanogpt_shaped:tiny' is refused by the runtime: cp hands"
    ):
        rows(NANOGPT, 64, gpus=4, gpu="h100", cp=2)


@pytest.mark.slow
def test_torchtitan_shapes_get_tp_and_cp_rows():
    stats = stats_of(TITAN, 16)
    assert stats.refused == {}
    assert (stats.cp.layers, stats.cp.heads, stats.cp.kv_heads, stats.cp.head_dim, stats.cp.seq_len) == (2, 4, 2, 8, 16)
    assert stats.tp.splits_activations and not stats.tp.sequence_parallel  # attention and MLP split in every block
    model = shapes.titan_llama()
    blocks = sum(
        p.numel()
        for n, p in model.layers.named_parameters()
        if n.endswith(("wq.weight", "wk.weight", "wv.weight", "wo.weight", "w1.weight", "w2.weight", "w3.weight"))
    )
    assert sum(stats.tp.split) == blocks + 2 * model.output.weight.numel()  # untied: embedding and head
    assert stats.tp.largest == 2  # over 4 ranks the 2 key/value heads do not split: the runtime's plan differs
    _, found = rows(TITAN, 16, gpus=4, gpu="h100")
    assert found == {(1, 1), (1, 2), (2, 1)}  # each rank of tp x cp takes whole key/value heads: 2 of them
    _, asked = rows(TITAN, 16, gpus=4, gpu="h100", tp=2, cp=2)
    assert {(2, 2), (2, 1), (1, 2)} <= asked  # asked past the key/value heads: the all-gather, as the runtime runs it


def test_a_model_tp_cannot_split_gets_no_tp_rows_and_the_runtimes_reason():
    stats = stats_of("mlp", 784)
    assert stats.tp is None and stats.refused["tp"].startswith(
        "tp_plan='auto' found nothing in Sequential it can split"
    )
    plan, found = rows("mlp", 784, gpus=2, gpu="h100")
    assert {t for t, _ in found} == {1}
    assert any(
        n.startswith("no tp rows: the runtime refuses tp on this model (tp_plan='auto' found nothing")
        for n in plan.notes
    )
    with pytest.raises(ConfigError, match=r"^--tp for 'mlp' is refused by the runtime: tp_plan='auto' found nothing"):
        rows("mlp", 784, gpus=2, gpu="h100", tp=2)


def test_tp_and_cp_at_one_ask_the_runtime_nothing():
    stats = stats_of(NANOGPT, 64, tp=1, cp=1)
    assert stats.tp is None and stats.cp is None and stats.refused == {}


def test_hand_written_attention_marked_as_a_kernel_gets_cp_rows():
    """nanoGPT's slow path moved into an ``is_attention_kernel`` module, its forward taking ``positions=``
    (docs/context-parallel.md#hand-written-attention): cp finds the module, and so does the plan."""
    stats = stats_of("helpers.cp_workers:NanoGPTForCP", 16)
    assert "cp" not in stats.refused
    assert (stats.cp.layers, stats.cp.heads, stats.cp.kv_heads, stats.cp.head_dim, stats.cp.seq_len) == (2, 4, 4, 8, 16)


def test_a_mixture_whose_routing_needs_values_has_its_attention_found_on_this_cpu():
    """DeepSeek-V3's shape routes by counts per expert, which the meta device does not hold: cp's attention is found
    by a forward on this CPU instead (the runtime trains it with cp: tests/distributed/test_context_parallel.py)."""
    stats = stats_of("helpers.shapes:titan_dsv3", 16, tp=1)
    assert stats.refused == {} and (stats.cp.layers, stats.cp.heads, stats.cp.seq_len) == (3, 4, 16)
