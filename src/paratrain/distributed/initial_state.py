"""Every rank starts from rank 0's initial weights, whatever the strategy.

DDP broadcasts rank 0's parameters when it wraps a model, so a script that seeds each rank differently before
building its model (nanoGPT's ``torch.manual_seed(1337 + rank)``) still trains one model. Sharding strategies do
not: FSDP keeps each rank's shard of its own tensors, a tensor-parallel split scatters only within its group, a
parameter server takes each server's part of its own copy, so the model trained would be a silent mix of every
rank's initialization. ``prepare`` therefore compares a checksum of every rank's initial state (a few integer sums,
gathered: no weight crosses the network when they agree, the usual case) and broadcasts rank 0's state only when
they differ. A model built on the meta device has no values yet: there the random state its initialization replays
from is rank 0's (:class:`~paratrain.model.materialize.Materializer`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..model.materialize import is_meta

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def checksum(tensors: list[torch.Tensor], chunk: int = 1 << 24) -> int:
    """An integer summary of ``tensors``' bits that differs, all but surely, when two ranks initialized them from
    different random draws (sums of the raw bits and of their squares, read in chunks: no copy of a whole tensor)."""
    total = 0
    for i, t in enumerate(tensors):
        bits = t.detach().contiguous().view(-1).view(_BITS[t.element_size()])
        for part in bits.split(chunk):
            wide = part.to(torch.int64)
            total = (total * 31 + i + int(wide.sum()) + 7 * int((wide * wide).sum())) % (1 << 61)
    return total


def agree_initial_state(model: nn.Module, device: torch.device) -> list[int]:
    """Make every rank's parameters and buffers rank 0's (collective); returns the ranks whose own differed (and
    were overwritten), empty when all agreed."""
    tensors = [t for t in [*model.parameters(), *model.buffers()] if t is not None]
    mine = torch.tensor([checksum(tensors)], dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    differ = [r for r, s in enumerate(every) if int(s) != int(every[0])]
    if differ:
        with torch.no_grad():
            for t in tensors:
                sent = t.detach().to(device)
                dist.broadcast(sent, src=0)
                if sent is not t:
                    t.detach().copy_(sent)
    return differ


def agree_rng_state(state: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Rank 0's random state (collective): what a model built on the meta device replays its initialization from."""
    sent = state.clone().to(device)
    dist.broadcast(sent, src=0)
    return sent.cpu()


def start_alike(
    model: nn.Module, materializer: object | None, device: torch.device, say: Callable[[str], None]
) -> None:
    """Every rank starts from rank 0's initial state (collective): a model built on the meta device replays its
    initialization from rank 0's random state (``materializer``'s, or torch's where the strategy materializes it),
    any other is checked and, where ranks differ, overwritten with rank 0's, ``say``-ing which ranks differed."""
    if materializer is not None:
        materializer.rng_state = agree_rng_state(materializer.rng_state, device)  # type: ignore[attr-defined]
        return
    if is_meta(model):  # a strategy that materializes its own way (parameter servers): from rank 0's stream
        torch.set_rng_state(agree_rng_state(torch.get_rng_state(), device))
        return
    differ = agree_initial_state(model, device)
    if differ:
        ranks = ", ".join(map(str, differ[:8])) + (" …" if len(differ) > 8 else "")
        say(
            f"paratrain: rank{'s' if len(differ) > 1 else ''} {ranks} built other initial weights than rank 0 (seeded "
            "differently before building the model?); every rank starts from rank 0's"
        )
