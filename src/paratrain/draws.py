"""What each data-parallel replica draws at random once ``prepare`` has built the model.

Scripts without a ``DataLoader`` draw their batches from the global random stream (nanoGPT's ``get_batch``:
``torch.randint`` offsets into the data). Seeded alike on every rank — or not seeded, which is torch's one fixed
default seed — every replica would draw the same batches and train on 1/N of the data it should, silently. So
after ``prepare`` each replica moves to a stream of its own, derived from rank 0's seed (``seed=`` when given,
else the seed torch was given on rank 0) and its replica index; the ranks of one replica (a tensor-parallel group,
a pipeline's stages) share theirs, so they draw the same batch and the same dropout. Code that needs one draw on
every rank (its own index-based sharding) uses a ``torch.Generator`` of its own, seeded alike.

As a last guard the first batch each rank feeds the model is compared across the job (a checksum of its input,
gathered once): identical batches on two replicas are a warning on rank 0, and so are different batches on the
ranks of one replica (a tp, cp or pp group), which must read the same; so is the first forward outside ``par.step``
(generation, evaluation) where every forward needs every rank: a script that seeds its sampling with ``par.rank``
feeds a tp group's ranks different tokens.
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
    """Compares the first batch every rank feeds the model once (see the module docstring)."""

    def __init__(self) -> None:
        self.done = False

    def check(self, batch: Any, replica: int, shared_by: str, device: torch.device, *, when: str, across: bool) -> None:
        """On the first call only (collective over every rank): warn on rank 0 when the ranks of one data-parallel
        replica (``shared_by``: its tp, cp or pp group) feed the model different batches at ``when``, or, with
        ``across``, two replicas the same one; ``replica``: this rank's index among them."""
        if self.done:
            return
        self.done = True
        mine = torch.tensor([*_digest(batch), replica], dtype=torch.int64, device=device)
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        digests = [tuple(t.tolist()) for t in every]
        line = _disagreement(digests, shared_by, when, across) if dist.get_rank() == 0 else None
        if line is not None:
            print(f"paratrain: warning: {line}", file=sys.stderr, flush=True)


def _digest(batch: Any) -> tuple[int, int]:
    """(CRC-32 of ``batch``'s bytes, its element count); (-1, 0) when it is no tensor (a stage given none)."""
    if not isinstance(batch, torch.Tensor):
        return -1, 0
    data = batch.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return zlib.crc32(data), batch.numel()


def _disagreement(digests: list[tuple[int, int, int]], shared_by: str, when: str, across: bool) -> str | None:
    """What is wrong with every rank's (crc, count, replica) of its batch at ``when``, or None; ``across``: two
    replicas reading one batch is wrong too."""
    first: dict[int, tuple[int, tuple[int, int]]] = {}  # replica -> its first rank given a batch, and its digest
    for rank, (crc, count, replica) in enumerate(digests):
        if crc < 0:
            continue
        known = first.setdefault(replica, (rank, (crc, count)))
        if known[1] != (crc, count):
            return (
                f"ranks {known[0]} and {rank} of {shared_by} got different inputs at {when}: their batches must be "
                "the same; seed per data-parallel replica (par.data_parallel_rank), not par.rank "
                "(docs/porting.md, randomness per rank)"
            )
    if not across:
        return None
    seen: dict[tuple[int, int], int] = {}
    for replica, (_, digest) in sorted(first.items()):
        if digest in seen:
            return (
                f"data-parallel replicas {seen[digest]} and {replica} fed the model identical first batches, so "
                "they would train on the same samples; shard the data (prepare a DataLoader) or draw each "
                "replica's own (docs/porting.md, data without a DataLoader)"
            )
        seen[digest] = replica
    return None


ONE_REPLICA = "one replica"
"""What :func:`shared_by` says where each rank is a replica of its own."""


def shared_by(names: tuple[str, ...], sizes: tuple[int, ...]) -> str:
    """The group of ranks inside one data-parallel replica, in words (``a tp group``), from the mesh's dimensions."""
    inner = [n for n, size in zip(names, sizes) if n in ("pp", "cp", "tp") and size > 1]
    return f"a {' x '.join(inner)} group" if inner else ONE_REPLICA
