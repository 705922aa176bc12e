"""The cross-entropy of a linear head's logits, computed a chunk of tokens at a time, so the ``tokens x vocabulary``
logits never exist whole.

At a long sequence and a large vocabulary the logits are the largest tensor of a step: 8192 tokens of a 128k
vocabulary are 4 GiB in fp32, and the softmax's backward needs as much again. Here the head and the loss run over
``chunk`` tokens at a time, and each chunk's gradients (for the hidden states, the head's weight and its bias) are
computed right there in the forward, while that chunk's logits exist; the backward only scales them by the gradient
it receives. So one chunk's logits live at a time, and the backward never reads the head's weight again, which
matters under FSDP, where the weight has been resharded by then. This is how Liger-Kernel's fused linear
cross-entropy works (cut cross-entropy recomputes the logits in the backward instead), written in plain PyTorch
ops so it runs on any device.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import ConfigError

REDUCTIONS = ("mean", "sum")


def chunked_cross_entropy(
    hidden: torch.Tensor,
    head: nn.Linear,
    targets: torch.Tensor,
    *,
    chunk: int = 4096,
    ignore_index: int = -100,
    reduction: str = "mean",
    softcap: float | None = None,
) -> torch.Tensor:
    """``F.cross_entropy`` of ``head(hidden)`` against ``targets`` (flattened over every dimension but the last),
    with the logits computed ``chunk`` tokens at a time and never whole.

    Args:
        hidden: what the head reads, ``(..., hidden_size)``.
        head: the output layer, an ``nn.Linear`` whose weight is a plain tensor (call this inside the model's
            forward under FSDP, where the weight is gathered; a head split over the vocabulary by tensor
            parallelism is not supported).
        targets: class indices shaped like ``hidden`` without its last dimension.
        chunk: tokens per chunk: the logits of this many tokens exist at once (``chunk x vocabulary`` floats).
        ignore_index, reduction: as ``F.cross_entropy`` (``"mean"``: over the targets not ignored).
        softcap: Gemma-style soft-capping, ``softcap * tanh(logits / softcap)``, before the softmax.
    """
    if reduction not in REDUCTIONS:
        raise ConfigError(f"chunked_cross_entropy: reduction {reduction!r} is not one of {', '.join(REDUCTIONS)}")
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise ConfigError(f"chunked_cross_entropy: chunk must be a whole number of tokens >= 1, got {chunk!r}")
    if hidden.shape[:-1] != targets.shape:
        raise ConfigError(
            f"chunked_cross_entropy: targets of shape {tuple(targets.shape)} do not match hidden states "
            f"of shape {tuple(hidden.shape)} (want {tuple(hidden.shape[:-1])})"
        )
    if _is_dtensor(head.weight):
        raise ConfigError(
            "chunked_cross_entropy: the head's weight is a DTensor (split by tensor parallelism or "
            "sharded by FSDP outside its forward); call it inside the model's forward, without tp"
        )
    flat, rows = targets.reshape(-1), hidden.reshape(-1, hidden.shape[-1])
    inputs = (rows, head.weight, head.bias, flat, chunk, ignore_index, softcap)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs[:3]):
        total = _HeadCrossEntropy.apply(*inputs)
    else:  # nothing to differentiate: no gradients computed
        total = _forward(*inputs, need=(False, False, False))[0]
    return total / (flat != ignore_index).sum() if reduction == "mean" else total


class _HeadCrossEntropy(torch.autograd.Function):
    """The summed cross-entropy of ``linear(hidden, weight, bias)``; gradients computed in the forward."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        chunk: int,
        ignore_index: int,
        softcap: float | None,
    ) -> torch.Tensor:
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        total, ctx.grads = _forward(
            hidden, weight, bias, targets, chunk, ignore_index, softcap, need=ctx.needs_input_grad[:3]
        )
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        scaled = tuple(None if g is None else (g * grad).to(dtype) for g, dtype in zip(ctx.grads, ctx.dtypes))
        ctx.grads = None
        return (*scaled, None, None, None, None)


def _forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    chunk: int,
    ignore_index: int,
    softcap: float | None,
    need: tuple[bool, ...],
) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...]]:
    """The summed loss and its gradients for (hidden, weight, bias) where ``need`` says so. A gradient is kept in
    its input's dtype, except fp16, whose range would flush small gradients before the loss scale reaches them;
    the head's gradients add up over the chunks in fp32."""
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    g_hidden = torch.empty(hidden.shape, dtype=_kept(hidden), device=hidden.device) if need[0] else None
    g_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need[1] else None
    g_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need[2] and bias is not None else None
    for start in range(0, hidden.shape[0], chunk):
        rows = slice(start, start + chunk)
        total += _chunk(
            hidden[rows],
            weight,
            bias,
            targets[rows],
            ignore_index,
            softcap,
            None if g_hidden is None else g_hidden[rows],
            g_weight,
            g_bias,
        )
    if g_weight is not None:
        g_weight = g_weight.to(_kept(weight))
    return total, (g_hidden, g_weight, g_bias)


def _chunk(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    y: torch.Tensor,
    ignore_index: int,
    softcap: float | None,
    g_hidden: torch.Tensor | None,
    g_weight: torch.Tensor | None,
    g_bias: torch.Tensor | None,
) -> torch.Tensor:
    """One chunk's summed loss; its gradients written into ``g_hidden`` and added to ``g_weight``, ``g_bias``.
    A function of its own so that its logits are freed on return, before the next chunk's exist."""
    logits = F.linear(h, weight, bias).float()
    capped = None
    if softcap is not None:
        capped = logits.div_(softcap).tanh_()
        logits = capped * softcap
    kept = y != ignore_index
    picked = y.masked_fill(~kept, 0).unsqueeze(1)
    right = logits.gather(1, picked)
    top = logits.amax(dim=-1, keepdim=True)
    g = logits.sub_(top).exp_()  # the softmax's numerators, in the logits' own memory (one pass, no copy)
    norm = g.sum(dim=-1, keepdim=True)
    loss = ((top + norm.log() - right).squeeze(1) * kept).sum()  # log-sum-exp minus the right logit
    if g_hidden is None and g_weight is None and g_bias is None:
        return loss
    g.div_(norm).scatter_add_(1, picked, -kept.to(g.dtype).unsqueeze(1)).mul_(kept.unsqueeze(1))
    if capped is not None:
        g.mul_(capped.square_().neg_().add_(1))
    if g_hidden is not None:
        g_hidden.copy_(g.to(weight.dtype) @ weight)
    if g_weight is not None:
        g_weight += g.t().to(h.dtype) @ h
    if g_bias is not None:
        g_bias += g.sum(0)
    return loss


def _kept(t: torch.Tensor) -> torch.dtype:
    return torch.float32 if t.dtype == torch.float16 else t.dtype


def _is_dtensor(t: torch.Tensor) -> bool:
    """Without importing ``torch.distributed.tensor`` (a second's import): no DTensor exists before it is imported."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)
