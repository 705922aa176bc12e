"""A tp group's rows divided among its ranks for their experts, and brought back whole.

Beside tensor parallelism every rank of a tp group is given the same rows (the experts stay whole to tp), so each
would compute every row's experts: the same FLOPs tp times. Instead each keeps its share, the ``r``-th of ``tp``
consecutive chunks of the rows (``torch.chunk``'s cut, the last ones shorter or empty where tp does not divide
them), with what the router chose for those rows; it sends only those over its expert group, and the outputs are
gathered over tp. The cut and the gather are DTensor redistributions over the tp mesh (``Replicate`` to
``Shard(0)`` and back, torch's functional collectives underneath), so their backward is the adjoint TP expects:
the rows' gradient gathered whole on every rank, the outputs' gradient cut to each rank's share. Each rank's expert
gradient comes from its share of the rows only: :func:`summed_over_tp` sums it over the group in the backward.

No host read: the cut is taken from the rows' shape, the counts of a share (rows sorted by expert) are clamped on
the device.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ...model.experts import Routing


def share_bounds(rows: int, rank: int, ranks: int) -> tuple[int, int]:
    """The rows ``[lo, hi)`` rank ``rank`` of ``ranks`` keeps: ``torch.chunk``'s cut, as ``Shard(0)`` makes it."""
    size = -(-rows // ranks)
    lo = min(rank * size, rows)
    return lo, min(lo + size, rows)


def own_share(given: Routing, tp: DeviceMesh) -> Routing:
    """This tp rank's share of ``given``: its chunk of the rows, and their choices (each token's experts and
    weights) or their counts per expert (the rows sorted by expert: each expert's rows that fall in the chunk)."""
    lo, hi = share_bounds(len(given.rows), tp.get_local_rank(), tp.size())
    rows = _cut(given.rows, tp)
    if given.top_k:
        assert isinstance(given.chosen, torch.Tensor) and given.weights is not None
        return Routing(rows, given.chosen[lo:hi], _cut(given.weights, tp))
    if isinstance(given.chosen, list):  # on the host already: counted there
        ends = itertools.accumulate(given.chosen)
        within = [min(max(e, lo), hi) - min(max(e - c, lo), hi) for e, c in zip(ends, given.chosen, strict=True)]
        return Routing(rows, within)
    return Routing(rows, _within(given.chosen, lo, hi))


def _within(counts: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """How many of each expert's rows (rows sorted by expert, ``counts`` of each) lie in ``[lo, hi)``, on the
    counts' device, in their dtype."""
    ends = counts.cumsum(0)
    return (ends.clamp(lo, hi) - (ends - counts).clamp(lo, hi)).to(counts.dtype)


def _cut(tensor: torch.Tensor, tp: DeviceMesh) -> torch.Tensor:
    """This rank's chunk of ``tensor`` (the same on every rank of ``tp``); its gradient gathered over ``tp``."""
    whole = DTensor.from_local(tensor, tp, [Replicate()], run_check=False)
    return whole.redistribute(tp, [Shard(0)]).to_local()


def gather_over_tp(out: torch.Tensor, given: Routing, share: Routing, tp: DeviceMesh) -> torch.Tensor:
    """Every rank's ``out`` (its ``share``'s output) gathered over ``tp``: one output row per row of ``given``.
    Rows past those counted (rows sorted by expert: ``counts`` that sum to less) come back as zeros, as the loop of
    torchtitan's experts gives its padding rows."""
    out = F.pad(out, (0, 0) * (out.dim() - 1) + (0, len(share.rows) - len(out))) if len(out) < len(share.rows) else out
    shape = torch.Size((len(given.rows), *out.shape[1:]))
    stride = torch.empty(shape, device="meta").stride()  # the whole tensor's, contiguous
    part = DTensor.from_local(out, tp, [Shard(0)], run_check=False, shape=shape, stride=stride)
    return part.redistribute(tp, [Replicate()]).to_local()


def summed_over_tp(local: torch.Tensor, tp: DeviceMesh) -> torch.Tensor:
    """``local`` (a parameter, the same on every rank of ``tp``) as it is, its gradient summed over ``tp``: each rank
    computed its share of the rows with it."""
    return DTensor.from_local(local, tp, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
