"""Planner model statistics: closed forms against real modules, meta tracing against real runs, no weights."""

import os
import time
import tracemalloc

import pytest
import torch
from helpers.activations import saved_bytes
from torch import nn

from paratrain.errors import ConfigError
from paratrain.model.structure import forward_pieces
from paratrain.planner import (
    InputSpec,
    ModelSpec,
    PlanConfig,
    make_plan,
    measure_module,
    trace_module,
    transformer_stats,
)
from paratrain.planner.transformer import transformer_params
from paratrain.workloads.digits import digits_cnn
from paratrain.workloads.gpt import GPT, GPT_CONFIGS, GPTConfig
from paratrain.workloads.model_names import SMALL_MODELS, parse_count, resolve_model


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_per_module_stats_match_counting_a_real_models_parameters():
    model = digits_cnn()
    stats = trace_module(digits_cnn, InputSpec.parse("1x8x8"), name="cnn")
    assert stats.params == sum(p.numel() for p in model.parameters())
    assert dict(stats.units) == {n: sum(p.numel() for p in m.parameters()) for n, m in model.named_children()}
    largest = max(
        ((n, sum(p.numel() for p in m.parameters(recurse=False))) for n, m in model.named_modules()), key=lambda x: x[1]
    )
    assert stats.largest_layer == largest == ("6", 32 * 16 * 128 + 128)
    assert stats.param_bytes == {"float32": 4 * stats.params}


@pytest.mark.parametrize("name", list(GPT_CONFIGS))
def test_closed_form_counts_equal_the_gpt_module_built_on_meta(name):
    cfg = GPT_CONFIGS[name]
    with torch.device("meta"):
        model = GPT(cfg)
    assert all(p.is_meta for p in model.parameters())  # llama-7b: 6.7B parameters, nothing allocated
    counts = transformer_params(cfg)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["block"] == sum(p.numel() for p in model.blocks[0].parameters())
    assert transformer_stats(cfg, name=name).params == counts["total"]
    expected = {
        "gpt2": 124_439_808,
        "gpt2-medium": 354_823_168,
        "gpt2-large": 774_030_080,
        "gpt2-xl": 1_557_611_200,
        "llama-7b": 6_738_415_616,
    }
    assert counts["total"] == expected.get(name, counts["total"])


def test_closed_form_flops_and_activations_agree_with_a_meta_trace():
    cfg = GPT_CONFIGS["gpt-tiny"]
    closed = transformer_stats(cfg, name="tiny")
    traced = trace_module(lambda: GPT(cfg), InputSpec.parse(f"long:{cfg.seq_len}"), name="tiny")
    assert traced.params == closed.params
    assert traced.flops_per_sample == pytest.approx(closed.flops_per_sample, rel=0.05)
    # attention runs the fused kernel on the meta device too (planner.attention): no s x s scores are saved
    assert traced.activation_bytes_per_sample == pytest.approx(closed.activation_bytes_per_sample, rel=0.01)
    assert traced.checkpointed_bytes_per_sample < traced.activation_bytes_per_sample
    assert traced.matmul_params == closed.matmul_params
    assert traced.output_bytes_per_sample == closed.output_bytes_per_sample


@pytest.mark.parametrize(
    "cfg",
    [
        GPTConfig(layers=2, hidden=64, heads=4, seq_len=64, vocab=512),
        GPTConfig(
            layers=2,
            hidden=128,
            heads=2,
            seq_len=64,
            vocab=300,
            ffn=256,
            gated=True,
            bias=False,
            learned_positions=False,
            tied=False,
        ),  # LLaMA-shaped: RMSNorm, SwiGLU, untied head
        GPTConfig(
            layers=2,
            hidden=128,
            heads=8,
            kv_heads=2,
            seq_len=64,
            vocab=300,
            ffn=256,
            gated=True,
            bias=False,
            learned_positions=False,
            tied=False,
            qkv_bias=True,
        ),  # Qwen2-shaped: grouped-query attention
    ],
    ids=["gpt2-like", "llama-like", "gqa"],
)
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_closed_form_activations_equal_what_autograd_saves_on_cpu(cfg, autocast):
    stats = transformer_stats(cfg, name="tiny")
    batch = 2
    predicted = batch * (stats.mixed["autocast"][0] if autocast else stats.activation_bytes_per_sample)
    predicted += 2 * stats.matmul_params if autocast else 0  # autocast's bf16 weight copies
    measured = saved_bytes(GPT(cfg), torch.randint(0, cfg.vocab, (batch, cfg.seq_len)), autocast)
    assert predicted == pytest.approx(measured, rel=0.02)


def test_mlp_activation_estimate_is_close_to_a_real_forward():
    factory, spec = SMALL_MODELS["mlp"]
    traced = trace_module(factory, InputSpec.parse(spec), name="mlp")
    measured = measure_module(factory, InputSpec.parse(spec), name="mlp", batch=16, steps=1)
    assert measured.activation_bytes_per_sample == traced.activation_bytes_per_sample  # same storages, real vs meta
    weights = 784 * 1024 + 1024 * 1024 + 1024 * 10
    # 6 FLOPs per weight, less the input gradient the first layer never computes
    assert measured.flops_per_sample == traced.flops_per_sample == 6 * weights - 2 * 784 * 1024
    assert measured.measured_step_s > 0 and measured.measured_batch == 16
    # independently: the CPU allocator's net allocations during a real forward, as the profiler records them
    model, batch = factory(), 512
    x = torch.randn(batch, 784)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        out = model(x)
    held = sum(e.self_cpu_memory_usage for e in prof.key_averages())  # saved tensors and the output stay alive
    estimate = traced.activation_bytes_per_sample * batch - x.numel() * 4 + out.numel() * 4  # x existed before
    assert held == pytest.approx(estimate, rel=0.1)


def test_a_7b_model_plans_in_under_a_second_without_allocating_weights():
    make_plan(resolve_model("gpt2"), PlanConfig(gpu="h100", gpus=8))  # imports warmed up
    tracemalloc.start()
    rss = _rss()
    start = time.perf_counter()
    plan = make_plan(resolve_model("llama-7b"), PlanConfig(gpu="h100", gpus=8))
    by_params = make_plan(
        resolve_model(ModelSpec(params="7.5B", layers=32, hidden=4096, seq_len=4096)),
        PlanConfig(gpu="a100", gpus=8, nodes=2),
    )
    elapsed = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert elapsed < 5.0  # ~0.5 s under tracemalloc on 2 cores: a bound that catches a weight allocation or a hang
    assert peak < 20 * 2**20 and _rss() - rss < 200 * 2**20  # weights alone would be 27 GB
    assert plan.stats.params == 6_738_415_616 and by_params.stats.params == 7_500_000_000
    assert plan.choice.name != "ddp" and plan.choice.fits  # 16 bytes x 6.7B > 80 GiB: something sharded


def test_params_shapes_and_input_specs():
    assert parse_count("7.5B") == 7.5e9 and parse_count("350m") == 350e6 and parse_count("1200") == 1200
    stats = resolve_model(ModelSpec(params="7B"))  # shape guessed from GPT-3's aspect ratio
    assert stats.params == 7_000_000_000 and "layers" in stats.source
    assert InputSpec.parse("long:1024").dtype == torch.long and InputSpec.parse("3x32x32").shape == (3, 32, 32)
    with pytest.raises(ConfigError, match="cannot read 'lots'"):
        parse_count("lots")
    with pytest.raises(ConfigError, match="bad input shape"):
        InputSpec.parse("3xbig")
    with pytest.raises(ConfigError, match="needs --input"):
        resolve_model("test_planner_stats:_factory")


def _factory() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4))


def test_module_factory_is_traced_on_meta_and_units_expand_module_lists():
    stats = resolve_model(ModelSpec(model="test_planner_stats:_factory", input_spec="4")).find_stats()
    assert stats.params == 20 and "meta" in stats.source
    model = nn.Module()
    model.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))
    model.head = nn.Linear(2, 1)
    assert [n for n, _ in forward_pieces(model)] == ["layers.0", "layers.1", "layers.2", "head"]


def test_a_transformers_model_is_planned_with_its_blocks_as_units():
    """The units FSDP shards (model.units): the embeddings, each block, the final norm, the head — not the root's
    children (``transformer`` whole and ``lm_head``), which made the gathered unit the whole model."""
    from helpers.zoo import ZOO

    from paratrain.model.structure import forward_pieces

    names = [n for n, _ in forward_pieces(ZOO["gpt2"].build())]
    assert names == [
        "transformer.wte",
        "transformer.wpe",
        "transformer.drop",
        "transformer.h.0",
        "transformer.h.1",
        "transformer.ln_f",
        "lm_head",
    ]
    assert [n for n, _ in forward_pieces(ZOO["cnn"].build())] == [str(i) for i in range(9)]  # no blocks: the children
