"""What each data-parallel replica draws at random once ``prepare`` has built the model.

Scripts without a ``DataLoader`` draw their batches from the global random stream (nanoGPT's ``get_batch``:
``torch.randint`` offsets into the data). Seeded alike on every rank — or not seeded, which is torch's one fixed
default seed — every replica would draw the same batches and train on 1/N of the data it should, silently. So
after ``prepare`` each replica moves to a stream of its own, derived from rank 0's seed (``seed=`` when given,
else the seed torch was given on rank 0) and its replica index; the ranks of one replica (a tensor-parallel group,
a pipeline's stages) share theirs, so they draw the same batch and the same dropout. Code that needs one draw on
every rank (its own index-based sharding) uses a ``torch.Generator`` of its own, seeded alike.

As a last guard the first batch each replica feeds the model is compared across replicas (a checksum of its
input, gathered once): identical batches on two replicas are a warning on rank 0.
"""

from __future__ import annotations

import sys
import zlib
from typing import Any

import torch
import torch.distributed as dist

from .seeding import rank_seed, seed_all


def agreed_seed(seed: int | None, device: torch.device) -> int:
    """Rank 0's ``seed``, or when None rank 0's torch initial seed (collective when a process group is up): what
    every replica's stream derives from. Agreed before the model is wrapped, since some strategies' wrapping is
    where their ranks part ways (a parameter server starts serving)."""
    base = seed if seed is not None else torch.initial_seed()
    if dist.is_available() and dist.is_initialized():
        shared = torch.tensor([base % (1 << 62)], dtype=torch.int64, device=device)
        dist.broadcast(shared, src=0)
        base = int(shared)
    return base


def replica_stream(base: int, replica: int) -> None:
    """Seed Python, NumPy and torch for ``replica`` from the agreed ``base``."""
    seed_all(rank_seed(base, replica))


class FirstBatch:
    """Compares the first batch of every data-parallel replica once (see the module docstring)."""

    def __init__(self) -> None:
        self.done = False

    def check(self, batch: Any, group: dist.ProcessGroup | None, size: int, device: torch.device) -> None:
        """On the first call only: warn on rank 0 when two replicas of ``group`` (``size`` of them) feed the model
        the same ``batch`` (collective over the group)."""
        if self.done:
            return
        self.done = True
        if size < 2 or not isinstance(batch, torch.Tensor):
            return
        data = batch.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        mine = torch.tensor([zlib.crc32(data), batch.numel()], dtype=torch.int64, device=device)
        every = [torch.zeros_like(mine) for _ in range(size)]
        dist.all_gather(every, mine, group=group)
        seen: dict[tuple[int, int], int] = {}
        for replica, digest in enumerate(every):
            key = (int(digest[0]), int(digest[1]))
            if key in seen and dist.get_rank() == 0:
                print(
                    f"paratrain: warning: data-parallel replicas {seen[key]} and {replica} fed the model identical "
                    "first batches, so they would train on the same samples; shard the data (prepare a "
                    "DataLoader) or draw each replica's own (docs/porting.md, data without a DataLoader)",
                    file=sys.stderr,
                    flush=True,
                )
                return
            seen.setdefault(key, replica)
