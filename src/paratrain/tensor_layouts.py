"""Tensors grouped by layout for torch's multi-tensor ops.

One call of a multi-tensor op (``torch._foreach_*``: the ``foreach`` optimizers CUDA defaults to, clipping;
``fused`` optimizers; the grad scaler's unscale) takes plain tensors, or DTensors, never both ("got mixed
torch.Tensor and DTensor"). Expert parallelism puts the experts on a mesh of their own beside plain or
data-parallel parameters, and tensor parallelism lays parameters out in several ways on one mesh. DTensor's rule
for the unscale reduces the found-inf flag as the first gradient of the call is laid out, so there the placements
must agree too: a layout is the mesh and the placements.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar

import torch

T = TypeVar("T")


def mesh_of(t: torch.Tensor) -> Hashable:
    """A DTensor's mesh; None for a plain tensor (read without importing DTensor, which costs 1-2 s)."""
    return getattr(t, "device_mesh", None)


def layout_of(t: torch.Tensor) -> Hashable:
    """A DTensor's mesh and placements; None for a plain tensor."""
    mesh = mesh_of(t)
    return None if mesh is None else (mesh, tuple(t.placements))  # type: ignore[attr-defined]


def grouped(items: list[T], key: Callable[[T], Hashable]) -> list[list[T]]:
    """``items`` grouped by ``key``, each group and the groups in first-seen order (the same on every rank, as
    DTensor ops over them are collectives)."""
    groups: dict[Hashable, list[T]] = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return list(groups.values())
