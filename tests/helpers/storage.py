"""The largest storage an operation makes, for tests that hold a path's memory to a bound (linear in the sequence,
never the whole logits)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LargestStorage(TorchDispatchMode):
    """The largest storage (bytes) any operation made while active, forward and backward: a zero-stride view
    counts as what it holds."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = [t.untyped_storage().nbytes() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.bytes = max([self.bytes, *sizes])
        return out
