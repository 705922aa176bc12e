"""Package attributes imported on first use, so that importing a package stays cheap (``paratrain run`` starts as
fast as ``torchrun``; ``Parallel()`` does not pay for torch.distributed.checkpoint before a checkpoint is made)."""
from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, exports: Mapping[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports ``exports[name]`` (a module relative to it) on first
    access to ``name`` and keeps the value in ``namespace`` (the package's globals)."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name], package), name)
        namespace[name] = value
        return value

    return __getattr__
