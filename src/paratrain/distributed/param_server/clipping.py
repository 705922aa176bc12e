"""Gradient clipping where the gradient is split between dense parameters and table rows.

One process's ``clip_grad_norm_`` sees a table's gradient as one dense tensor, each row holding the sum of every
lookup of it. Here the rows arrive as (ids, gradients) with repeats (several lookups, several forwards, several
workers), so a row's repeats are summed before it counts: the norm is the one that process would compute. The
coefficient is ``clip_grad_norm_``'s: ``min(1, max_norm / (norm + 1e-6))``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def squared_norm(dense: Iterable[torch.Tensor], rows: Iterable[tuple[int, torch.Tensor, torch.Tensor]]) -> float:
    """The sum of squares of the ``dense`` gradients and of the table rows' gradients ``rows`` ((table, ids,
    gradients); a row's repeats summed first), in float64."""
    total = sum(float(torch.linalg.vector_norm(g, dtype=torch.float64)) ** 2 for g in dense)
    per_table: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for table, ids, grads in rows:
        per_table.setdefault(table, []).append((ids, grads))
    for parts in per_table.values():
        ids, grads = torch.cat([i for i, _ in parts]), torch.cat([g for _, g in parts])
        if not ids.numel():
            continue
        unique, inverse = torch.unique(ids, return_inverse=True)
        summed = torch.zeros(unique.numel(), grads.shape[1], dtype=torch.float64)
        total += float(summed.index_add_(0, inverse, grads.to(torch.float64)).pow(2).sum())
    return total


def clip_coefficient(norm: float, max_norm: float) -> float:
    """What every gradient is multiplied by to clip a norm of ``norm`` to ``max_norm`` (as ``clip_grad_norm_``)."""
    return min(1.0, max_norm / (norm + 1e-6))
