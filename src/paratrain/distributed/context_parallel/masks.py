"""The whole sequence's attention mask, for a kernel that sees whole sequences under context parallelism.

The model builds its masks for the rank's slice of the sequence (or none: transformers skips them for an
attention function it does not know), so the kernel gets one built here from the call's whole 2-D padding mask
instead: causal (where the module is) and padded keys masked, in the form the kernel reads.
"""
from __future__ import annotations

import torch


def whole_mask(padding: torch.Tensor | None, length: int, causal: bool, form: str, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor | None:
    """``[b or 1, 1, length, length]`` for the whole sequence, or None where the kernel masks by itself (SDPA's
    ``is_causal`` without padding). ``form``: ``"bool"`` (True attends: SDPA) or ``"additive"`` (0 or the dtype's
    minimum, added to the scores: eager attention)."""
    padded = padding is not None and not bool(padding.all())
    if form == "bool" and causal and not padded:
        return None
    allowed = torch.ones(length, length, dtype=torch.bool, device=device)
    if causal:
        allowed = allowed.tril()
    allowed = allowed[None, None]
    if padded:
        assert padding is not None
        allowed = allowed & padding.to(device=device, dtype=torch.bool)[:, None, None, :]
    if form == "bool":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
