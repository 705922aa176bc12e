"""Package attributes imported on first use, so that importing a package stays cheap (``paratrain run`` starts as
fast as ``torchrun``; ``Parallel()`` does not pay for torch.distributed.checkpoint before a checkpoint is made)."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(
    package: str,
    exports: Mapping[str, str],
    namespace: dict[str, Any],
    deprecated: Mapping[str, tuple[str, str]] | None = None,
) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports ``exports[name]`` (a module relative to it) on first
    access to ``name`` and keeps the value in ``namespace`` (the package's globals). ``deprecated``: former names →
    (their module, what to write instead), still served, with a warning each time."""
    deprecated = deprecated or {}

    def __getattr__(name: str) -> Any:
        if name in deprecated:
            module, instead = deprecated[name]
            warnings.warn(f"{package}.{name} is deprecated; {instead}", FutureWarning, stacklevel=2)
            return getattr(importlib.import_module(module, package), name)
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name], package), name)
        namespace[name] = value
        return value

    return __getattr__
