"""A minimal decoder-only transformer (GPT-2 / LLaMA shaped) and the built-in size configurations.

The module exists so that sizes can be built on the meta device (``with torch.device("meta"): GPT(cfg)``) and
checked against the planner's closed-form counts, and so that a tiny one can train for real. It keeps only
what changes parameter counts, FLOPs and activation memory: no dropout, no weight-init scheme, and the
LLaMA-like configuration leaves out rotary position embeddings (they add no parameters and negligible FLOPs).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """The shape of a decoder-only transformer."""

    layers: int
    """Transformer blocks."""
    hidden: int
    """Model width (d_model)."""
    heads: int
    """Attention heads; ``hidden`` must divide evenly."""
    seq_len: int = 1024
    """Tokens per sample (context length)."""
    vocab: int = 50257
    """Vocabulary size (GPT-2's tokenizer by default)."""
    ffn: int | None = None
    """MLP inner width; default 4 x hidden."""
    gated: bool = False
    """SwiGLU MLP (three matrices, LLaMA) instead of GELU (two matrices, GPT-2)."""
    bias: bool = True
    """Linear layers and norms carry biases (GPT-2 yes, LLaMA no: RMSNorm and bias-free linears)."""
    learned_positions: bool = True
    """A learned position table of ``seq_len x hidden`` (GPT-2); LLaMA uses rotary embeddings instead."""
    tied: bool = True
    """The output projection shares the token embedding's weights (GPT-2)."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq_len", "vocab"):
            if getattr(self, name) < 1:
                raise ConfigError(f"transformer {name} must be >= 1, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ConfigError(f"hidden {self.hidden} is not divisible by heads {self.heads}")
        if self.ffn is not None and self.ffn < 1:
            raise ConfigError(f"transformer ffn must be >= 1, got {self.ffn}")

    @property
    def ffn_width(self) -> int:
        return self.ffn if self.ffn is not None else 4 * self.hidden


def _llama_ffn(hidden: int) -> int:
    """LLaMA's MLP width: 2/3 of 4h, rounded up to a multiple of 256 (11008 for h=4096)."""
    return 256 * math.ceil(8 * hidden / 3 / 256)


GPT_CONFIGS = MappingProxyType({
    "gpt2": GPTConfig(layers=12, hidden=768, heads=12),                  # 124M
    "gpt2-medium": GPTConfig(layers=24, hidden=1024, heads=16),          # 355M
    "gpt2-large": GPTConfig(layers=36, hidden=1280, heads=20),           # 774M
    "gpt2-xl": GPTConfig(layers=48, hidden=1600, heads=25),              # 1.56B
    "llama-7b": GPTConfig(layers=32, hidden=4096, heads=32, seq_len=2048, vocab=32000, ffn=_llama_ffn(4096),
                          gated=True, bias=False, learned_positions=False, tied=False),  # 6.74B
    "gpt-tiny": GPTConfig(layers=2, hidden=64, heads=4, seq_len=64, vocab=512),          # 0.17M, for tests
})
"""Built-in sizes: GPT-2's four published sizes and a LLaMA-7B-like shape."""


class RMSNorm(nn.Module):
    """Root-mean-square norm with a scale and no bias (LLaMA)."""

    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Block(nn.Module):
    """Pre-norm attention and MLP with residuals.

    ``qkv``'s outputs are grouped per head (``q k v`` of head 0, then of head 1, …) and a gated ``fc``'s per unit
    (gate, up), so that a contiguous column split — tensor parallelism — gives each rank whole heads and units.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        h, f = cfg.hidden, cfg.ffn_width
        norm = (lambda: nn.LayerNorm(h)) if cfg.bias else (lambda: RMSNorm(h))
        self.head_dim = h // cfg.heads
        self.gated = cfg.gated
        self.norm1 = norm()
        self.qkv = nn.Linear(h, 3 * h, bias=cfg.bias)
        self.proj = nn.Linear(h, h, bias=cfg.bias)
        self.norm2 = norm()
        self.fc = nn.Linear(h, 2 * f if cfg.gated else f, bias=cfg.bias)
        self.out = nn.Linear(f, h, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Shapes come from the projections' outputs, not from x: under tensor parallelism x holds a slice of the
        # sequence and qkv this rank's heads.
        qkv = self.qkv(self.norm1(x))
        b, t, _ = qkv.shape
        q, k, v = qkv.view(b, t, -1, 3 * self.head_dim).transpose(1, 2).chunk(3, dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, -1))
        z = self.fc(self.norm2(x))
        if self.gated:
            gate, up = z.unflatten(-1, (-1, 2)).unbind(-1)
            z = F.silu(gate) * up
        else:
            z = F.gelu(z)
        return x + self.out(z)


class GPT(nn.Module):
    """Token ids (batch, seq) → logits (batch, seq, vocab)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.hidden)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.hidden) if cfg.learned_positions else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.hidden) if cfg.bias else RMSNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tied:
            self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

