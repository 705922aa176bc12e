"""Rows sorted by expert through their experts' fused 3-D weights: grouped GEMM where the device has it, a loop of
matmuls elsewhere, both from the same counts without a host sync of their own.

A mixture of experts' layer sorts its token copies by expert and runs each expert on its rows. Where grouped GEMM
exists (``torch.nn.functional.grouped_mm``: bf16 on a CUDA device of capability 9.0 or more, the kernels torchtitan's
``GroupedExperts`` and transformers' ``grouped_mm`` experts use) one kernel takes every expert's rows at once,
delimited by offsets that stay on the device. Elsewhere (CPU, fp32, older GPUs) the portable path splits the rows
by the counts on the host, one small matmul per expert. Each layer reads its counts on the host at most once, and
only where the loop needs them: the difference between one device->host sync per layer and one per expert.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

GROUPED_MM_CAPABILITY = (9, 0)
"""The CUDA capability from which expert layers use grouped GEMM (Hopper: torch's bf16 grouped kernels)."""
ALIGN_BYTES = 16
"""Grouped GEMM wants every row of both operands to start on a 16-byte boundary."""

Groups = list[int] | torch.Tensor
"""How rows sorted by expert are delimited: each expert's row count on the host (the loop), or the running end of
each expert's rows as int32 on the device (grouped GEMM's ``offs``)."""


def count_per_expert(ids: torch.Tensor, experts: int) -> torch.Tensor:
    """How many of ``ids`` name each of ``experts`` (ids outside ``0..experts-1`` are not counted), on their device.

    A scatter, not ``bincount``: CUDA's ``bincount`` reads the largest id on the host to size its output."""
    slots = ids.reshape(-1).to(torch.int64).clamp(0, experts)  # out of range: into one extra slot, dropped
    counts = torch.zeros(experts + 1, dtype=torch.int64, device=ids.device)
    return counts.scatter_add_(0, slots, torch.ones_like(slots))[:experts]


def grouped_mm_fits(rows: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether grouped GEMM runs ``rows`` through ``weights`` (``[experts, out, in]`` or their transposes): bf16
    throughout, on a CUDA device of capability :data:`GROUPED_MM_CAPABILITY` or more, every row 16-byte aligned."""
    if rows.device.type != "cuda" or not hasattr(F, "grouped_mm"):
        return False
    if torch.cuda.get_device_capability(rows.device) < GROUPED_MM_CAPABILITY:
        return False
    tensors = (rows, *weights)
    return (
        all(t.dtype == torch.bfloat16 for t in tensors)
        and all(
            t.shape[-1] * t.element_size() % ALIGN_BYTES == 0 and t.shape[-2] * t.element_size() % ALIGN_BYTES == 0
            for t in weights
        )
        and rows.shape[-1] * rows.element_size() % ALIGN_BYTES == 0
    )


def expert_groups(
    rows: torch.Tensor, counts: torch.Tensor | list[int], grouped: bool, host: list[int] | None = None
) -> Groups:
    """``counts`` (``rows`` per expert) as the path needs them: int32 offsets on ``rows``' device for grouped GEMM,
    else a list on the host (``host`` when the caller already holds them there; otherwise one read of ``counts``)."""
    if grouped:
        on_device = counts if isinstance(counts, torch.Tensor) else torch.tensor(counts, device=rows.device)
        return on_device.cumsum(0, dtype=torch.int32)
    if host is not None:
        return host
    return counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)


def expert_linear(
    rows: torch.Tensor, weight: torch.Tensor, groups: Groups, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Each expert's rows of ``rows`` (sorted by expert, delimited by ``groups``) times its ``weight[e]``
    (``[experts, out, in]``, as ``F.linear`` takes it) plus its ``bias[e]``."""
    if isinstance(groups, torch.Tensor):
        out = F.grouped_mm(rows, weight.transpose(-2, -1), offs=groups)
        if bias is None:
            return out
        expert_of_row = torch.searchsorted(groups, torch.arange(rows.shape[0], device=rows.device), right=True)
        return out + bias[expert_of_row.clamp(max=bias.shape[0] - 1)]
    biases = [None] * len(groups) if bias is None else bias.unbind()
    return torch.cat(
        [F.linear(part, w, b) for part, w, b in zip(rows.split(groups), weight.unbind(), biases, strict=True)]
    )


def fused_gate(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """How transformers' fused-experts ``module`` turns its ``gate_up_proj`` output into the ``down_proj`` input,
    when it is one this module can run (transformers 5's ``use_experts_implementation`` marks them: gated, no
    per-expert norm); None otherwise."""
    if not hasattr(module, "is_transposed") or not getattr(module, "has_gate", False):
        return None
    if getattr(module, "has_post_expert_norm", False) or not all(
        isinstance(getattr(module, name, None), torch.Tensor) and getattr(module, name).dim() == 3
        for name in ("gate_up_proj", "down_proj")
    ):
        return None
    apply_gate = getattr(module, "_apply_gate", None)
    if apply_gate is not None:
        return apply_gate

    def gate(z: torch.Tensor) -> torch.Tensor:
        g, up = z.chunk(2, dim=-1)
        return module.act_fn(g) * up

    return gate


def run_fused_experts(
    module: nn.Module, rows: torch.Tensor, counts: torch.Tensor | list[int], host: list[int] | None = None
) -> torch.Tensor:
    """``rows`` sorted by expert (``counts`` of each) through transformers' fused experts ``module`` (one that
    :func:`fused_gate` accepts), each row computed as its expert computes it, without the routing weight."""
    gate = fused_gate(module)
    assert gate is not None
    up_w, down_w = module.gate_up_proj, module.down_proj
    if module.is_transposed:  # [experts, in, out] (GPT-OSS): as F.linear takes them
        up_w, down_w = up_w.transpose(-2, -1), down_w.transpose(-2, -1)
    groups = expert_groups(rows, counts, grouped_mm_fits(rows, up_w, down_w), host)
    z = expert_linear(rows, up_w, groups, getattr(module, "gate_up_proj_bias", None))
    return expert_linear(gate(z), down_w, groups, getattr(module, "down_proj_bias", None))
