"""The Ulysses exchange: an all-to-all that trades a sequence split for a head split before attention, and one that
trades back after it (DeepSpeed Ulysses' method).

Each of the ``C`` ranks of a context-parallel group holds 1/C of every sequence, for every head. Attention needs
whole sequences, but each head is computed on its own; so before the kernel, rank ``i`` sends every rank ``j`` its
slice of the sequence for head group ``j`` and receives head group ``i`` for every slice: ``[b, h, s/C, d] ->
[b, h/C, s, d]``. The kernel (any: SDPA, eager, a model's own) runs on whole sequences for its heads; the
exchange back restores ``[b, h, s/C, d]``. Both are torch's functional ``all_to_all_single_autograd``, whose
backward is the reverse exchange, so autograd needs nothing of ours.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import (
    all_to_all_single_autograd,
    wait_tensor,
)

from ...errors import ConfigError


def sequence_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[b, h, s/C, d]`` (this rank's slice of the sequence, every head) -> ``[b, h/C, s, d]`` (the whole sequence,
    this rank's group of heads)."""
    ranks = dist.get_world_size(group)
    b, h, s, d = x.shape
    if h % ranks:
        raise ConfigError(
            f"cp={ranks} splits the {h} heads attention sees on this rank into {ranks} groups, which "
            f"does not divide; choose a cp that divides {h}, or cp_method='allgather'"
        )
    chunks = x.reshape(b, ranks, h // ranks, s, d).transpose(0, 1).contiguous()  # chunk j goes to rank j
    out = _exchange(chunks, group)  # chunk i: rank i's slice, my heads
    return out.permute(1, 2, 0, 3, 4).reshape(b, h // ranks, ranks * s, d)


def heads_to_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[b, h/C, s, d]`` -> ``[b, h, s/C, d]``: the inverse of :func:`sequence_to_heads`."""
    ranks = dist.get_world_size(group)
    b, h, s, d = x.shape
    chunks = x.reshape(b, h, ranks, s // ranks, d).permute(2, 0, 1, 3, 4).contiguous()  # slice j goes to rank j
    out = _exchange(chunks, group)  # chunk i: rank i's heads, my slice
    return out.transpose(0, 1).reshape(b, ranks * h, s // ranks, d)


def _exchange(chunks: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Chunk ``j`` of dimension 0 to rank ``j``, chunk ``i`` back from rank ``i``: a plain tensor (waited for), so
    what autograd saves of it and the kernels that read it see no asynchronous wrapper."""
    return wait_tensor(all_to_all_single_autograd(chunks, None, None, group))
