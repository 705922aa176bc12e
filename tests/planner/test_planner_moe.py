"""Mixture-of-experts shapes in closed form (``planner.moe``, ``GPTConfig.moe``) against the real module
(``workloads.experts``): parameters, what autograd saves, FLOPs; total against active parameters."""

import re

import pytest
import torch
from helpers.activations import saved_bytes

from paratrain.errors import ConfigError
from paratrain.planner import GPTConfig, InputSpec, measure_module, transformer_stats
from paratrain.planner.moe import MoE, expert_params
from paratrain.planner.transformer import block_params, transformer_params
from paratrain.workloads.gpt import GPT

_LLAMA = dict(
    hidden=64, heads=4, seq_len=32, vocab=100, gated=True, bias=False, learned_positions=False, tied=False, ffn=96
)
SHAPES = {
    "mixtral-like": GPTConfig(layers=2, **_LLAMA, kv_heads=2, moe=MoE(experts=4, top_k=2, ffn=24)),
    "shared-gated": GPTConfig(layers=2, **_LLAMA, moe=MoE(experts=4, top_k=1, ffn=24, shared=40, shared_gate=True)),
    "qwen3-like": GPTConfig(
        layers=3,
        **_LLAMA,
        kv_heads=2,
        head_dim=32,
        qk_norm=True,
        moe=MoE(experts=8, top_k=3, ffn=16, dense_layers=(1,)),
    ),
    "gelu-biases": GPTConfig(
        layers=2,
        hidden=64,
        heads=4,
        seq_len=32,
        vocab=100,
        moe=MoE(experts=4, top_k=2, ffn=24, shared=40, bias=True, dense_layers=(0,)),
    ),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_moe_counts_equal_the_module_block_by_block(name):
    cfg = SHAPES[name]
    model = GPT(cfg)
    counts = transformer_params(cfg)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert [n for n, _, _ in block_params(cfg)] == [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    routed = [0 if b.moe is None else sum(p.numel() for p in b.moe.experts.parameters()) for b in model.blocks]
    assert [x for _, _, x in block_params(cfg)] == routed and counts["experts"] == sum(routed)
    idle = (cfg.moe.experts - cfg.moe.top_k) * expert_params(cfg.moe, cfg.hidden, cfg.gated)
    assert counts["active"] == counts["total"] - idle * sum(1 for r in routed if r)
    stats = transformer_stats(cfg, name=name)
    assert stats.tensors == tuple(p.numel() for p in model.parameters())
    assert stats.moe.unit_experts == (0, *routed, 0) and stats.moe.layers == sum(1 for r in routed if r)


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_moe_activations_equal_what_autograd_saves_on_cpu(name, autocast):
    """Routing changes which expert computes a token, never how many rows the experts compute (k a token): the
    closed form holds whatever the router picks. Autocast copies every expert's weights it uses (here all)."""
    cfg = SHAPES[name]
    stats = transformer_stats(cfg, name=name)
    torch.manual_seed(0)
    batch = 2
    predicted = batch * (stats.mixed["autocast"][0] if autocast else stats.activation_bytes_per_sample)
    predicted += 2 * stats.matmul_params if autocast else 0
    measured = saved_bytes(GPT(cfg), torch.randint(0, cfg.vocab, (batch, cfg.seq_len)), autocast)
    assert predicted == pytest.approx(measured, rel=0.005)


@pytest.mark.parametrize("name", ["mixtral-like", "qwen3-like"])
def test_moe_flops_count_the_active_parameters(name):
    """FlopCounterMode on a real forward and backward (routing needs real tensors: no meta trace): 6 FLOPs per
    active parameter per token, plus attention's."""
    cfg = SHAPES[name]
    closed = transformer_stats(cfg, name=name)
    measured = measure_module(lambda: GPT(cfg), InputSpec.parse(f"long:{cfg.seq_len}"), name=name, batch=2, steps=1)
    assert measured.flops_per_sample == pytest.approx(closed.flops_per_sample, rel=0.01)
    assert measured.activation_bytes_per_sample == pytest.approx(closed.activation_bytes_per_sample, rel=0.005)
    lookups, attention = cfg.vocab * cfg.hidden, 12 * cfg.layers * cfg.attention_width * cfg.seq_len**2
    assert closed.flops_per_sample == 6 * (transformer_params(cfg)["active"] - lookups) * cfg.seq_len + attention


@pytest.mark.parametrize(
    "shape, message",
    [
        (dict(experts=4, top_k=5, ffn=8), "MoE top_k 5 must be between 1 and its 4 experts"),
        (dict(experts=1, top_k=1, ffn=8), "an MoE needs at least 2 experts"),
        (dict(experts=4, top_k=1, ffn=8, shared_gate=True), "gates its shared experts; give their width"),
        (dict(experts=4, top_k=1, ffn=8, dense_layers=(1, 1)), "must be distinct block indices"),
    ],
)
def test_a_bad_moe_shape_is_one_line(shape, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        MoE(**shape)


def test_moe_shapes_the_closed_forms_cannot_take_are_one_line():
    with pytest.raises(ConfigError, match=r"dense_layers \(5,\) name blocks beyond the 2 layers"):
        GPTConfig(layers=2, **_LLAMA, moe=MoE(experts=4, top_k=1, ffn=8, dense_layers=(5,)))
    with pytest.raises(ConfigError, match="--params sizes a dense transformer"):
        transformer_stats(SHAPES["mixtral-like"], name="x", params=10**6)
