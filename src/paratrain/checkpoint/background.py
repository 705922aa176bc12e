"""Asynchronous saves: the job's state is staged (copied) when it is saved, written by torch.distributed.checkpoint's
``async_save`` in a background thread while training goes on, and published once it is complete.

* At most one save is in flight: a new save (blocking or not), a load and ``close`` first wait for it (a load
  and ``close`` until every rank's is published: a rank may read it next).
* The write's collectives run on a gloo group of their own over the saving ranks, so they never interleave with
  the training's collectives (torchtitan does the same; DCP's asynchronous save needs a CPU backend anyway).
* Rank 0 publishes (``meta.json``, the rename, ``latest``, pruning) on the training thread, at the first batch,
  step, save or close after its write completed; ``latest`` only ever names complete checkpoints, so a kill while
  a save is in flight loses that save and nothing else.
* A failed write is one line at that point: the partial folder is removed and the previous checkpoint kept.

A script that ends without ``close`` still finishes its save: the interpreter waits for the writing thread before
it exits, and an ``atexit`` hook then publishes it.
"""
from __future__ import annotations

import atexit
import inspect
import sys
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..errors import CheckpointError, ConfigError
from . import io, layout


def check_support() -> None:
    """Refuse, in one line, a torch whose ``async_save`` lacks what these saves use: staging that copies tensors
    already on the CPU (torch 2.6 wrote the live tensors, which training changes meanwhile: pytorch#144657) and a
    write without a process group (``no_dist``, for a parameter server's shard), both there from torch 2.9."""
    import torch.distributed.checkpoint as dcp

    if "no_dist" not in inspect.signature(dcp.async_save).parameters:
        raise ConfigError(f"asynchronous checkpoints need torch >= 2.9 (this is {torch.__version__}); upgrade torch "
                          "or save without async_save (CheckpointConfig(async_save=False), no --checkpoint-async)")


@dataclass
class _InFlight:
    """A save being written: DCP's future, and what publishing it takes."""

    future: Future
    strategy: Any
    rank: int
    root: Path
    tmp: Path
    keep: int
    meta: dict[str, Any]
    nbytes: int

    def finish(self) -> None:
        """Wait for the write; then rank 0 has the servers' shards confirmed (a parameter server's) and publishes.
        A failure is one line on the rank that meets it."""
        try:
            self.future.result()
            self.strategy.shards_written(self.tmp, self.rank)
            if self.rank == 0:
                io.publish(self.root, self.tmp, self.meta, self.keep)
        except io.DCP_ERRORS as e:
            raise io.write_failure(self.root, self.tmp, e, self.nbytes, self.rank) from None


class BackgroundSaves:
    """The asynchronous saves of one ``Parallel``: at most one in flight, published from the training thread."""

    def __init__(self, timeout_s: float) -> None:
        self._timeout = timedelta(seconds=timeout_s)
        self._group: dist.ProcessGroup | None = None
        self._pending: _InFlight | None = None
        self._unsettled = False
        """A save started since the last ``settle``: every rank agrees on it (saves are collective), while a rank
        may have published its save already and another not."""

    def start(self, t: io.Targets, root: Path, keep: int) -> Path:
        """Wait for the save in flight, stage ``t``'s state and start writing it into ``root/step-…`` (collective);
        returns that folder, which appears once the write is complete."""
        import torch.distributed.checkpoint as dcp

        self.finish()
        check_support()
        group = self._writers(t)
        tmp = io.begin_save(t, root)
        state: dict[str, dict[str, Any]] = {}
        try:
            io.alike(t, lambda: t.strategy.save_shards(tmp, t.rank, background=True))  # a parameter server's
            state = io.tensor_state(t)
            if group is None:
                io.quiet_background()
            future = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(tmp), planner=io.rank0_planner(),
                                    process_group=group, no_dist=group is None)
        except io.DCP_ERRORS as e:
            raise io.write_failure(root, tmp, e, io.state_bytes(state), t.rank) from None
        self._pending = _InFlight(future=future, strategy=t.strategy, rank=t.rank, root=root, tmp=tmp, keep=keep,
                                  meta=io.checkpoint_meta(t), nbytes=io.state_bytes(state))
        self._unsettled = True
        atexit.register(self._at_exit)
        return root / layout.step_name(t.step)

    def poll(self) -> None:
        """Publish the save in flight if its write is complete (or raise its failure); never waits."""
        if self._pending is not None and self._pending.future.done():
            self.finish()

    def finish(self) -> None:
        """Wait for this rank's save in flight, if any, and publish it (rank 0)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            atexit.unregister(self._at_exit)
            pending.finish()

    def settle(self, barrier: Callable[[], None]) -> None:
        """Collective: once a save was started, wait until every rank's is finished and published."""
        if self._unsettled:
            self._unsettled = False
            self.finish()
            barrier()

    def _writers(self, t: io.Targets) -> dist.ProcessGroup | None:
        """The gloo group the writes' collectives run on: the saving ranks', made by them at the first save."""
        if not dist.is_initialized():
            return None
        if self._group is None:
            saving = t.strategy.checkpoint_group()
            ranks = list(range(dist.get_world_size())) if saving is None else dist.get_process_group_ranks(saving)
            self._group = dist.new_group(ranks, backend="gloo", timeout=self._timeout, use_local_synchronization=True)
        return self._group

    def _at_exit(self) -> None:
        """A script that ended without ``close``: its last save is written; publish it."""
        try:
            self.finish()
        except CheckpointError as err:
            print(f"paratrain: error: {err}", file=sys.stderr, flush=True)
