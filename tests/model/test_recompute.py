"""Activation checkpointing of the repeated blocks (paratrain.model.transforms): the same gradients, far less
activation memory, the user's parameter names kept, and the planner's --checkpointing figure matched."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from helpers.zoo import ZOO
from torch import nn

import paratrain
from paratrain import ConfigError
from paratrain.model.facts import ModelFacts
from paratrain.model.transforms import transform_blocks
from paratrain.options import BlockTransforms


def _saved(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss) -> tuple[Counter, dict[str, torch.Tensor]]:
    """Bytes of the storages autograd saves in forward (weights left out), by the block running; the gradients."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple[int, str]] = {}
    running = ["outside"]
    blocks = [
        m for m in model.modules() if type(m).__name__ in ("GPT2Block", "LlamaDecoderLayer", "BertLayer", "Block")
    ]
    hooks = [
        h
        for b in blocks
        for h in (
            b.register_forward_pre_hook(lambda *_, b=b: running.__setitem__(0, id(b))),
            b.register_forward_hook(lambda *_: running.__setitem__(0, "outside")),
        )
    ]

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in weights and key not in seen:
            seen[key] = (t.untyped_storage().nbytes(), running[0])
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        value = loss(model(x), y)
    value.backward()
    for h in hooks:
        h.remove()
    by: Counter = Counter()
    for nbytes, where in seen.values():
        by[where] += nbytes
    return by, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def checkpointed(model: nn.Module, every: int = 1) -> list[str]:
    """Checkpoint every ``every``-th block as prepare does; the names of the blocks that now recompute."""
    transform_blocks(model, ModelFacts.of(model), BlockTransforms(checkpoint_every=every))
    return [name for name, m in model.named_modules() if "forward" in vars(m)]


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "lora", "nanogpt"])
def test_same_gradients_less_saved_memory_same_names(name):
    spec = ZOO[name]
    x, y = spec.inputs(4, torch.Generator().manual_seed(0))
    plain, grads = _saved(spec.build(), x, y, spec.loss)
    model = spec.build()
    names = list(model.state_dict())
    assert len(checkpointed(model)) == 2
    kept, grads_ckpt = _saved(model, x, y, spec.loss)
    assert grads.keys() == grads_ckpt.keys()
    assert max((grads[k] - grads_ckpt[k]).abs().max().item() for k in grads) == 0.0
    assert sum(kept.values()) < 0.35 * sum(plain.values())
    assert list(model.state_dict()) == names and [n for n, _ in model.named_parameters()] == [
        n for n, _ in spec.build().named_parameters()
    ]


def test_every_kth_block_and_bad_values():
    from paratrain.workloads.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(layers=5, hidden=16, heads=2, seq_len=8, vocab=32))
    assert checkpointed(model, every=2) == ["blocks.0", "blocks.2", "blocks.4"]
    with pytest.raises(ConfigError, match="has none"):
        checkpointed(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)))
    for bad in (0, -1, "yes", 1.5):
        with pytest.raises(ConfigError, match="activation_checkpointing must be"):
            paratrain.Parallel("single", model=paratrain.ModelConfig(activation_checkpointing=bad))


def test_planner_checkpointing_figure_matches_the_measured_one():
    """The planner's --checkpointing activations: each block's input kept plus one block's activations rebuilt in
    backward. Measured: the bytes saved in a checkpointed forward plus the largest block's own saved bytes."""
    from paratrain.planner.model_stats import InputSpec, measure_module
    from paratrain.workloads.gpt import GPT, GPTConfig

    cfg = GPTConfig(layers=4, hidden=64, heads=4, seq_len=64, vocab=512)
    batch = 8

    def build() -> nn.Module:
        torch.manual_seed(0)
        return GPT(cfg)

    stats = measure_module(build, InputSpec.parse("long:64"), name="gpt", batch=batch, steps=1)
    x = torch.zeros(batch, 64, dtype=torch.long)
    total = lambda out, _: out.float().sum()  # noqa: E731  (the planner's own backward)
    plain, _ = _saved(build(), x, None, total)
    model = build()
    checkpointed(model)
    kept, _ = _saved(model, x, None, total)
    logits = 4 * batch * 64 * cfg.vocab  # the planner adds cross-entropy's fp32 log-probabilities
    largest_block = max(v for k, v in plain.items() if k != "outside")
    measured = sum(kept.values()) + largest_block + logits
    planned = stats.checkpointed_bytes_per_sample * batch
    assert planned == pytest.approx(measured, rel=0.05)
    assert planned < 0.5 * stats.activation_bytes_per_sample * batch
