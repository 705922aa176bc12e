"""Count, on any device, the calls that would make the host wait for a CUDA device: what ``torch.cuda.
set_sync_debug_mode`` reports on a GPU, seen on CPU.

On CPU nothing waits, so a hot path that reads device values on the host looks free there and stalls every step
on a GPU. :class:`HostSyncs` counts, while it is entered, each call of that kind: a read of a tensor's values on the
host (``.tolist()``; ``.item()``, ``bool()``, ``int()``, ``float()`` of a tensor), and the operators whose output
size CUDA learns only by reading the device (``nonzero``, ``bincount``, ``unique``, ``masked_select``, indexing by
a boolean mask, ``repeat_interleave`` without ``output_size``). Imports only torch, so it can be loaded by path
beside another checkout of paratrain.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Self

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
SIZE_FROM_DEVICE = frozenset(
    {
        _aten.nonzero.default,
        _aten.bincount.default,
        _aten.masked_select.default,
        _aten._unique2.default,
        _aten.unique_dim.default,
        _aten.unique_consecutive.default,
    }
)
"""Operators whose output size CUDA reads on the host."""


class HostSyncs(TorchDispatchMode):
    """While entered, ``count`` is the number of host reads of device values, ``calls`` what they were."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self._tolist: Any = None

    @property
    def count(self) -> int:
        return sum(self.calls.values())

    def __enter__(self) -> Self:
        original = self._tolist = torch.Tensor.tolist
        calls = self.calls

        def tolist(tensor: torch.Tensor) -> Any:
            calls["tolist"] += 1
            return original(tensor)

        torch.Tensor.tolist = tolist  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is _aten._local_scalar_dense.default:  # .item(), bool(), int(), float() of a tensor
            self.calls["item"] += 1
        elif func in SIZE_FROM_DEVICE:
            self.calls[str(func.overloadpacket.__name__)] += 1
        elif func is _aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            self.calls["repeat_interleave"] += 1
        elif func is _aten.index.Tensor and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
            self.calls["boolean index"] += 1
        return func(*args, **kwargs)
