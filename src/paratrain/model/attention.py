"""An attention kernel call as paratrain's interceptors read it: ``F.scaled_dot_product_attention``'s arguments bound
as SDPA binds them, positionally or by keyword. Three places stand in for that call (context parallelism's exchange
around it, the planner's trace on meta, the CUDA-shaped step's fused kernels); each reads the call through
:class:`SDPACall` instead of repeating SDPA's signature."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


class SDPACall(NamedTuple):
    """One call's arguments: ``SDPACall(*args, **kwargs)`` binds them as ``scaled_dot_product_attention`` does."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: torch.Tensor | None = None
    dropout_p: float = 0.0
    is_causal: bool = False
    scale: float | None = None
    enable_gqa: bool = False

    def options(self) -> dict[str, Any]:
        """The keywords beside q, k, v and the mask, to call the kernel again with."""
        keep = ("dropout_p", "is_causal", "scale", "enable_gqa")
        return {name: getattr(self, name) for name in keep}
