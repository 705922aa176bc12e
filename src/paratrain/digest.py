"""A SHA-256 of a model's parameters and buffers, so two runs can be compared bit for bit."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch
from torch import nn


def state_digest(state: nn.Module | Mapping[str, torch.Tensor]) -> str:
    """Hex SHA-256 over every state_dict entry's name, dtype, shape and raw bytes, in name order."""
    h = hashlib.sha256()
    items = state.state_dict().items() if isinstance(state, nn.Module) else state.items()
    for name, tensor in sorted(items):
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
