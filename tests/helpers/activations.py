"""What autograd saves during a real forward: the measure the planner's activation formulas are held to."""

from __future__ import annotations

import torch
from torch import nn


def saved_bytes(model: nn.Module, x: torch.Tensor, autocast: bool, target: torch.Tensor | None = None) -> int:
    """Bytes of the storages autograd saves during a real CPU forward and cross-entropy loss (weights excluded);
    the loss's targets are ``x`` unless given (a rank that holds a slice of the sequence: its slice)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(x)
        loss = nn.functional.cross_entropy(out.float().flatten(0, 1), (x if target is None else target).flatten())
    loss.backward()
    return sum(saved.values())
