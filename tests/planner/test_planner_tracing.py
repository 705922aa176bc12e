"""The planner traces the models it can build, whatever their shape: blocks in a ModuleDict, latent attention (value
heads narrower than query heads), routing that reads tensor values; what it cannot trace is one line."""

import json

import pytest
import torch
from helpers.shapes import Decoder, ShapeConfig, titan_dsv3, titan_llama
from torch import nn
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from paratrain.cli.main import main
from paratrain.errors import ConfigError
from paratrain.model.units import shard_units
from paratrain.planner import InputSpec, measure_module, trace_module
from paratrain.planner.attention import FusedAttention, attention_flops

IDS = InputSpec.parse("long:16")


def latent_dense() -> nn.Module:
    """DeepSeek-V3's latent attention (query/key heads 12 wide, value heads 6) in dense blocks: nothing to route."""
    torch.manual_seed(0)
    return Decoder(ShapeConfig(latent=True))


def test_value_heads_narrower_than_query_heads_run_a_fused_kernel_on_meta():
    """The output is value-wide; autograd keeps q, k, v, the output and a log-sum-exp, no s x s scores; the FLOPs
    are the closed forms' (forward and twice it backward), not the kernel's recomputation of the scores."""
    b, h, s, dq, dv = 2, 4, 16, 12, 6
    q, k = (torch.randn(b, h, s, dq, device="meta", requires_grad=True) for _ in range(2))
    v = torch.randn(b, h, s, dv, device="meta", requires_grad=True)
    saved: list[int] = []
    with (
        FlopCounterMode(display=False, custom_mapping=attention_flops()) as counter,
        FusedAttention(),
        torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t),
    ):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()
    assert out.shape == (b, h, s, dv) and v.grad.shape == v.shape
    assert counter.get_total_flops() == 3 * sdpa_flop_count(q.shape, k.shape, v.shape)
    assert max(saved) < b * h * s * s  # no scores kept
    lse = b * h * 32  # the log-sum-exp, its sequence rounded up to 32
    assert sum(n for n in saved if n > 1) == 2 * b * h * s * dq + 2 * b * h * s * dv + lse


def test_a_latent_attention_model_is_traced_on_meta_with_a_real_runs_flops():
    traced = trace_module(latent_dense, IDS, name="mla")
    real = measure_module(latent_dense, IDS, name="mla", batch=2, steps=1)
    assert "meta device" in traced.source
    assert traced.params == real.params and traced.flops_per_sample == real.flops_per_sample
    # CPU runs it unfused and keeps each layer's [h, s, s] attention weights, which the GPU's kernel does not
    assert traced.activation_bytes_per_sample < real.activation_bytes_per_sample


def test_routing_that_reads_values_is_traced_on_this_cpu():
    """DeepSeek-V3's experts take their token counts as split sizes (``.tolist()``): no values on the meta device."""
    stats = trace_module(titan_dsv3, IDS, name="dsv3")
    assert stats.source.startswith("traced on this CPU") and "Cannot copy out of meta tensor" in stats.source
    assert stats.params == sum(p.numel() for p in titan_dsv3().parameters())
    assert [n for n, _ in stats.units] == ["tok_embeddings", "layers.0", "layers.1", "layers.2", "norm", "output"]
    assert stats.flops_per_sample > 0 and stats.activation_bytes_per_sample > 0


class _HugeRouted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(2**31, 64)  # 137G parameters: only ever built on the meta device here

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.table(x)[: int(x.sum())]


def test_what_cannot_be_traced_is_one_line():
    with pytest.raises(ConfigError, match=r"cannot run on the meta device .* needs ~\d+.* plan its shape instead"):
        trace_module(_HugeRouted, IDS, name="huge")
    with pytest.raises(ConfigError, match=r"tracing 'llama' failed in its forward \(RuntimeError: .*check --input"):
        trace_module(titan_llama, InputSpec.parse("long:99"), name="llama")  # longer than its rotary table


def test_units_of_a_moduledict_model_are_zero3s_one_per_block():
    """The planner's units (``forward_pieces``) hold zero3's units (``shard_units``): each block alone, the largest
    unit FSDP gathers a block; the embedding and head, too small for units of their own, stay with the root."""
    model = titan_llama()
    stats = trace_module(titan_llama, IDS, name="llama")
    names = {id(m): n for n, m in model.named_modules()}
    zero3 = [[names[id(m)] for m in unit] for unit in shard_units(model)]
    assert zero3 == [["layers.0"], ["layers.1"]]
    units = dict(stats.units)
    assert list(units) == ["tok_embeddings", "layers.0", "layers.1", "norm", "output"]
    for (name,) in zero3:
        assert units[name] == sum(p.numel() for p in model.get_submodule(name).parameters())
    assert stats.largest_unit[0] in ("layers.0", "layers.1")


@pytest.mark.slow
@pytest.mark.parametrize("factory", ["titan_llama", "titan_qwen3", "titan_dsv3"])
def test_plan_model_plans_every_shape(factory, capsys):
    rc = main(["plan", "--model", f"helpers.shapes:{factory}", "--input", "long:16", "--gpus", "2", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    plan = json.loads(out)
    assert plan["recommendation"]["name"] and plan["model"]["units"] == (6 if factory == "titan_dsv3" else 5)
