"""A GPT in the shape of karpathy/nanoGPT's ``model.py``, written here to plan it as its users would.

What matters to the planner is the shape of its forward, not its weights: ``forward(idx, targets=None)`` computes
the logits of every position and the loss when it is given targets, and only the last position's logits when it is
not (what generation needs). Its modules are where nanoGPT keeps them: a ``transformer`` ModuleDict of ``wte``,
``wpe``, ``drop``, the blocks ``h`` and ``ln_f``, and an ``lm_head`` that shares the token embedding's weight.
Attention is torch's fused kernel, as nanoGPT runs it on torch 2.

``paratrain plan --model nanogpt_shaped:gpt2 --input long:1024`` (with ``tests`` importable) plans nanoGPT's default
124M model; ``tiny`` is a small one to run for real.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class Shape:
    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    bias: bool = True


class SelfAttention(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.heads = s.n_head
        self.c_attn = nn.Linear(s.n_embd, 3 * s.n_embd, bias=s.bias)
        self.c_proj = nn.Linear(s.n_embd, s.n_embd, bias=s.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.c_attn(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(s.n_embd, bias=s.bias)
        self.attn = SelfAttention(s)
        self.ln_2 = nn.LayerNorm(s.n_embd, bias=s.bias)
        self.mlp = nn.Sequential(nn.Linear(s.n_embd, 4 * s.n_embd, bias=s.bias), nn.GELU(),
                                 nn.Linear(4 * s.n_embd, s.n_embd, bias=s.bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(s.vocab_size, s.n_embd), wpe=nn.Embedding(s.block_size, s.n_embd), drop=nn.Dropout(0.0),
            h=nn.ModuleList(Block(s) for _ in range(s.n_layer)), ln_f=nn.LayerNorm(s.n_embd, bias=s.bias)))
        self.lm_head = nn.Linear(s.n_embd, s.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        t = self.transformer
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = t.drop(t.wte(idx) + t.wpe(pos))
        for block in t.h:
            x = block(x)
        x = t.ln_f(x)
        if targets is None:  # generation: the next token's logits only
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


def gpt2() -> GPT:
    """nanoGPT's default model: GPT-2 124M with its vocabulary padded to 50304."""
    return GPT(Shape())


def tiny() -> GPT:
    torch.manual_seed(0)
    return GPT(Shape(block_size=64, vocab_size=512, n_layer=2, n_head=4, n_embd=64))
