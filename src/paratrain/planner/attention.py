"""Attention as training runs it, for the planner's traces: the fused kernel, which saves no s x s matrix.

On the meta device ``F.scaled_dot_product_attention`` always takes its unfused path, which saves the attention
weights for backward: 576 MiB a sample in nanoGPT's 124M model at 1024 tokens (12 layers x 12 heads x 1024² x 4
bytes), 74% more than the whole model's activations as training on a GPU (or torch's fused CPU kernel) keeps them.
:class:`FusedAttention` sends those calls to torch's fused CPU kernel, which runs on the meta device and saves only
the output and the log-sum-exp, as a GPU's flash kernel does. That kernel takes one head size for queries, keys and
values; where the values' differs (DeepSeek-V3's multi-head latent attention: 192-wide query and key heads, 128-wide
value heads) a GPU runs another fused kernel (memory-efficient or cuDNN attention), which saves the same tensors:
the planner runs the memory-efficient one, whose meta function gives the value-wide output. ``FlopCounterMode``
counts no FLOP in the CPU kernel, and counts a recomputation of the scores in the memory-efficient one's backward:
``attention_flops`` counts both as the unfused path's matrix products (the s x s scores and their weighted sum,
twice that in backward), as the closed forms do (``transformer.transformer_stats``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import sdpa_flop_count

from ..model.attention import SDPACall

_FUSED = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_EFFICIENT = torch.ops.aten._scaled_dot_product_efficient_attention


def document_share(seq_len: int, document_tokens: int | None) -> float:
    """The share of a sequence's attention FLOPs that documents of ``document_tokens`` tokens packed in it compute:
    L/S; 1 when not packed (None) or when a document is as long as the sequence."""
    if document_tokens is None or document_tokens >= seq_len:
        return 1.0
    return document_tokens / seq_len


def attention_flops(document_tokens: int | None = None) -> dict[Any, Callable[..., int | float]]:
    """``FlopCounterMode``'s ``custom_mapping`` for the fused kernels (the CPU one, which a real CPU run takes too,
    and the memory-efficient one for differing value heads): forward the scores and their weighted sum, backward
    twice that; with ``document_tokens``, each call's for rows packed with documents of that many tokens
    (:func:`document_share` of its keys' sequence)."""

    def forward(q: tuple[int, ...], k: tuple[int, ...], v: tuple[int, ...], *args: object, **kwargs: object) -> float:
        return sdpa_flop_count(q, k, v) * document_share(k[-2], document_tokens)

    def backward(grad: tuple[int, ...], *inputs: tuple[int, ...], **kwargs: object) -> float:
        return 2 * forward(*inputs[:3])  # the query's, key's and value's shapes

    return {
        _FUSED: forward,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: backward,
        _EFFICIENT: forward,
        torch.ops.aten._scaled_dot_product_efficient_attention_backward: backward,
    }


class FusedAttention(TorchFunctionMode):
    """Within it, ``F.scaled_dot_product_attention`` on meta tensors without a mask or dropout runs a fused kernel
    (the memory-efficient one where the value heads are narrower or wider than the query heads); grouped key/value
    heads are repeated to the query's (the kernels take equal heads; the copies are a head's sequence each, not
    s x s)."""

    def __torch_function__(self, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            fused = _fused(SDPACall(*args, **kwargs))
            if fused is not None:
                return fused
        return func(*args, **kwargs)


def _fused(call: SDPACall) -> torch.Tensor | None:
    """The fused kernel's output for ``call`` on meta tensors; None for a call it cannot take."""
    q, k, v, attn_mask, dropout_p, is_causal, scale, _ = call
    if q.device.type != "meta" or attn_mask is not None or dropout_p or q.dim() != 4:
        return None
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    if v.shape[-1] != q.shape[-1]:
        return _EFFICIENT(q, k, v, None, True, 0.0, is_causal, scale=scale)[0]
    return _FUSED(q, k, v, 0.0, is_causal, scale=scale)[0]
