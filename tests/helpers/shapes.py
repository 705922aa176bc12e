"""Model shapes the zoo lacks, written the way torchtitan writes its models (plain ``nn.Module``s, our own code).

What paratrain must find by what the modules do, not by container class or argument name:

* the blocks live in an ``nn.ModuleDict`` (``layers["0"]``, …: names that survive a pipeline's cut) and the forward
  walks ``layers.values()``;
* attention calls an inner module that wraps ``F.scaled_dot_product_attention`` on ``[b, s, h, d]`` tensors (it
  transposes to ``[b, h, s, d]`` itself); rotary angles are looked up by 2-D ``positions`` (``[1 or b, s]``);
* the routed experts are a module not named ``experts``, called with the token rows sorted by expert and the count
  per expert as a floating tensor (what ``torch.histc`` returns), summed back with the router's top-k weights;
* DeepSeek-V3's multi-head latent attention: queries and keys of one head size, values of another, the keys and
  values decompressed from one latent per token, a rotary part shared by every head.

``titan_llama`` (untied, grouped-query), ``titan_qwen3`` (query/key norms, tied head) and ``titan_dsv3`` (latent
attention, a dense first block, then mixtures of experts with a shared expert) are built from tiny configs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from paratrain.workloads.gpt import RMSNorm

VOCAB, HIDDEN = 65, 32  # the zoo's vocabulary


@dataclass(frozen=True)
class ShapeConfig:
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 48
    seq_len: int = 16
    qk_norm: bool = False
    tied: bool = False
    latent: bool = False
    """DeepSeek-V3's latent attention instead of grouped-query attention."""
    experts: int = 0
    """Routed experts per block after the first (0: every block dense)."""
    top_k: int = 2


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary angles on ``x`` ``[b, s, h, d]``; ``cos``/``sin`` are ``[s, d/2]`` or ``[b or 1, s, d/2]``."""
    a, b = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2).type_as(x)


class ScaledDotProduct(nn.Module):
    """The attention kernel behind a wrapper: q, k, v ``[b, s, h, d]`` in, ``[b, s, h, d]`` out, causal."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        grouped = k.shape[1] != q.shape[1]
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped).transpose(1, 2)


class GroupedQueryAttention(nn.Module):
    def __init__(self, cfg: ShapeConfig) -> None:
        super().__init__()
        self.head_dim = HIDDEN // cfg.heads
        self.wq = nn.Linear(HIDDEN, cfg.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(HIDDEN, cfg.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(HIDDEN, cfg.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * self.head_dim, HIDDEN, bias=False)
        self.q_norm = RMSNorm(self.head_dim) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim) if cfg.qk_norm else None
        self.inner_attention = ScaledDotProduct()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        return self.wo(self.inner_attention(q, k, v).reshape(b, s, -1))


class LatentAttention(nn.Module):
    """Multi-head latent attention: keys and values decompressed from one latent per token; each head's query and
    key are ``NOPE + ROPE`` wide, its value ``VALUE`` wide; the keys' rotary part is one for every head."""

    NOPE, ROPE, VALUE, RANK = 8, 4, 6, 16

    def __init__(self, cfg: ShapeConfig) -> None:
        super().__init__()
        self.wq = nn.Linear(HIDDEN, cfg.heads * (self.NOPE + self.ROPE), bias=False)
        self.wkv_a = nn.Linear(HIDDEN, self.RANK + self.ROPE, bias=False)
        self.kv_norm = RMSNorm(self.RANK)
        self.wkv_b = nn.Linear(self.RANK, cfg.heads * (self.NOPE + self.VALUE), bias=False)
        self.wo = nn.Linear(cfg.heads * self.VALUE, HIDDEN, bias=False)
        self.inner_attention = ScaledDotProduct()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.NOPE + self.ROPE)
        q_nope, q_pe = q.split([self.NOPE, self.ROPE], dim=-1)
        q = torch.cat([q_nope, rotate(q_pe, cos, sin)], dim=-1)
        latent, k_pe = self.wkv_a(x).split([self.RANK, self.ROPE], dim=-1)
        k_pe = rotate(k_pe.unsqueeze(2), cos, sin)
        kv = self.wkv_b(self.kv_norm(latent)).view(b, s, -1, self.NOPE + self.VALUE)
        k_nope, v = kv.split([self.NOPE, self.VALUE], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        return self.wo(self.inner_attention(q, k, v).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, ffn: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(HIDDEN, ffn, bias=False)
        self.w2 = nn.Linear(ffn, HIDDEN, bias=False)
        self.w3 = nn.Linear(HIDDEN, ffn, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GroupedExperts(nn.Module):
    """Every routed expert's SwiGLU, stacked ``[experts, …]``; called with rows sorted by expert and a count per
    expert (a tensor), one matmul per expert."""

    def __init__(self, experts: int, ffn: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, ffn, HIDDEN) / HIDDEN**0.5)
        self.w2 = nn.Parameter(torch.randn(experts, HIDDEN, ffn) / ffn**0.5)
        self.w3 = nn.Parameter(torch.randn(experts, ffn, HIDDEN) / HIDDEN**0.5)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        outs = []
        for e, rows in enumerate(x.split([int(c) for c in num_tokens_per_expert.tolist()])):
            h = F.silu(rows @ self.w1[e].T) * (rows @ self.w3[e].T)
            outs.append(h @ self.w2[e].T)
        return torch.cat(outs)


class MoE(nn.Module):
    def __init__(self, cfg: ShapeConfig) -> None:
        super().__init__()
        self.top_k, self.num = cfg.top_k, cfg.experts
        self.gate = nn.Linear(HIDDEN, cfg.experts, bias=False)
        self.routed = GroupedExperts(cfg.experts, cfg.ffn // 2)
        self.shared = FeedForward(cfg.ffn // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        tokens = x.reshape(-1, h)
        scores, chosen = self.gate(tokens).float().softmax(-1).topk(self.top_k, dim=-1)
        counts = torch.histc(chosen.flatten().float(), bins=self.num, min=0, max=self.num)
        order = chosen.flatten().argsort(stable=True)
        rows = self.routed(tokens[order // self.top_k], counts)
        out = torch.zeros_like(rows)
        out[order] = rows * scores.flatten()[order, None].type_as(rows)
        return (out.view(-1, self.top_k, h).sum(1) + self.shared(tokens)).view(b, s, h)


class Block(nn.Module):
    def __init__(self, cfg: ShapeConfig, index: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(HIDDEN)
        self.attention = LatentAttention(cfg) if cfg.latent else GroupedQueryAttention(cfg)
        self.ffn_norm = RMSNorm(HIDDEN)
        moe = cfg.experts and index > 0
        self.moe = MoE(cfg) if moe else None
        self.feed_forward = None if moe else FeedForward(cfg.ffn)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        mlp = self.moe if self.moe is not None else self.feed_forward
        return x + mlp(self.ffn_norm(x))


class Decoder(nn.Module):
    """Token ids ``[b, s]`` (and optional 2-D ``positions``) → logits ``[b, s, vocab]``."""

    def __init__(self, cfg: ShapeConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.layers)})
        self.norm = RMSNorm(HIDDEN)
        self.output = nn.Linear(HIDDEN, VOCAB, bias=False)
        if cfg.tied:
            self.output.weight = self.tok_embeddings.weight
        rotary = LatentAttention.ROPE if cfg.latent else HIDDEN // cfg.heads
        angles = torch.outer(torch.arange(cfg.seq_len).float(), 1e4 ** -(torch.arange(0, rotary, 2).float() / rotary))
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if positions is None:
            cos, sin = self.cos[: tokens.shape[1]], self.sin[: tokens.shape[1]]
        elif positions.dim() == 2:  # [1 or b, s]: torchtitan's rotary asserts this shape
            cos, sin = self.cos[positions], self.sin[positions]
        else:
            raise ValueError(f"positions must be [1 or batch, seq], got {list(positions.shape)}")
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


def _built(cfg: ShapeConfig) -> nn.Module:
    torch.manual_seed(0)
    return Decoder(cfg)


def titan_llama() -> nn.Module:
    return _built(ShapeConfig())


def titan_qwen3() -> nn.Module:
    return _built(ShapeConfig(qk_norm=True, tied=True))


def titan_dsv3() -> nn.Module:
    return _built(ShapeConfig(layers=3, latent=True, experts=4))
