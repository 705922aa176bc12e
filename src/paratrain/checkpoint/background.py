"""Asynchronous saves: the job's state is staged (copied to host memory) and written by torch.distributed.checkpoint's
``async_save`` in background threads while training goes on, and published once it is complete.

* The copy goes through torch's ``DefaultStager``, one per job: its host buffers are allocated at the first save and
  refilled by the next ones (pinned, and filled by non-blocking copies on a stream of their own, where the state is on
  CUDA). The save call returns once the copy has started; the training thread waits for it to end only before
  something changes the state it copies: the next optimizer step (``wait_staged``), or the next forward of a model
  whose saved buffers a forward may change (BatchNorm's running statistics).
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
from concurrent.futures import Future, wait
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import CheckpointError, ConfigError
from . import io, layout


def check_support() -> None:
    """Refuse, in one line, a torch whose ``async_save`` lacks what these saves use: staging that copies tensors
    already on the CPU (torch 2.6 wrote the live tensors, which training changes meanwhile: pytorch#144657) and a
    write without a process group (``no_dist``, for a parameter server's shard), both there from torch 2.9."""
    import torch.distributed.checkpoint as dcp

    if "no_dist" not in inspect.signature(dcp.async_save).parameters:
        raise ConfigError(
            f"asynchronous checkpoints need torch >= 2.9 (this is {torch.__version__}); upgrade torch "
            "or save without async_save (CheckpointConfig(async_save=False), no --checkpoint-async)"
        )


def staging_options(gpus: int) -> Any:
    """How the stager copies a state on ``gpus`` CUDA devices: on a thread of its own, into buffers it keeps; pinned
    only from CUDA (torch pins through CUDA); by non-blocking copies on a stream of its own only from one device (torch
    refuses them without an accelerator, and that stream is one device's: the copies from several devices block each,
    on their device's default stream). No shared memory: the writer is a thread of this process."""
    from torch.distributed.checkpoint.staging import StagingOptions

    return StagingOptions(
        use_pinned_memory=gpus > 0, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=gpus == 1
    )


def new_stager(gpus: list[torch.device]) -> Any:
    """torch's ``DefaultStager`` for a state on the CUDA devices ``gpus`` (none: on the CPU); None on a torch without
    it, whose ``async_save`` then copies the state on the calling thread, into fresh buffers at every save. From one
    GPU it is made on that device: it copies on a stream it makes on the current device, and waits for that stream
    alone."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager
    except ImportError:
        return None
    with torch.cuda.device(gpus[0]) if len(gpus) == 1 else nullcontext():
        return DefaultStager(staging_options(len(gpus)))


def state_gpus(models: list[nn.Module]) -> list[torch.device]:
    """The CUDA devices the state to stage lives on: one, or several for a model split over a process's GPUs."""
    return sorted(
        {p.device for model in models for p in model.parameters() if p.device.type == "cuda"}, key=lambda d: d.index
    )


def computed(gpus: list[torch.device]) -> None:
    """Wait for the kernels that produced the state on ``gpus`` (the last step's) to finish: the stager copies on a
    stream of its own, which does not wait for the training's."""
    for gpu in gpus:
        torch.cuda.current_stream(gpu).synchronize()


def buffer_owners(models: list[nn.Module]) -> list[nn.Module]:
    """The modules whose forward may change saved state in place, each model's own (DDP broadcasts rank 0's
    buffers there) and every module holding a buffer of the state dict (BatchNorm's running statistics); none
    for models without such buffers."""
    owners = []
    for model in models:
        mine = [
            m
            for m in model.modules()
            if any(b is not None and n not in m._non_persistent_buffers_set for n, b in m._buffers.items())
        ]
        owners += [model, *mine] if mine else []
    return owners


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
            self.strategy.server.shards_written(self.tmp, self.rank)
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
        self._stager: Any = None
        """torch's stager, made at the first save and kept until ``close``: its buffers serve every save."""
        self._staging: Future | None = None
        """The copy of the save in flight while it runs in the background."""
        self._hooks: list[Any] = []
        """The hooks that wait for that copy before the state changes, removed once the save is published."""
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
        gpus = state_gpus(t.models)
        if self._stager is None:
            self._stager = new_stager(gpus)
        tmp = io.begin_save(t, root)
        state: dict[str, dict[str, Any]] = {}
        try:
            io.alike(t, lambda: t.strategy.server.save_shards(tmp, t.rank, background=True))  # a parameter server's
            state = io.tensor_state(t)
            if group is None:
                io.quiet_background()
            computed(gpus)
            response = dcp.async_save(
                state,
                storage_writer=dcp.FileSystemWriter(tmp, per_thread_copy_ahead=0),
                planner=io.rank0_planner(),
                process_group=group,
                no_dist=group is None,
                async_stager=self._stager,
            )
        except io.DCP_ERRORS as e:
            raise io.write_failure(root, tmp, e, io.state_bytes(state), t.rank) from None
        future = self._hold(response, t)
        self._pending = _InFlight(
            future=future,
            strategy=t.strategy,
            rank=t.rank,
            root=root,
            tmp=tmp,
            keep=keep,
            meta=io.checkpoint_meta(t),
            nbytes=io.state_bytes(state),
        )
        self._unsettled = True
        atexit.register(self._at_exit)
        return root / layout.step_name(t.step)

    def _hold(self, response: Any, t: io.Targets) -> Future:
        """DCP's future of the write. While the stager copies in the background, every prepared optimizer's next
        step and the next forward that may change a saved buffer first wait for the copy: a save holds the state
        of the step it was asked at."""
        if isinstance(response, Future):  # copied on this thread already
            return response
        self._staging = response.staging_completion

        def hold(*args: Any) -> None:  # an optimizer's step pre-hook, or a module's forward pre-hook
            self.wait_staged()

        self._hooks = [optimizer.register_step_pre_hook(hold) for _, optimizer in t.optimizers]
        self._hooks += [module.register_forward_pre_hook(hold) for module in buffer_owners(t.models)]
        return response.upload_completion

    def wait_staged(self) -> None:
        """Return once the copy of the save in flight is complete (a failed copy fails its write, which says so
        where it is published)."""
        if self._staging is not None:
            wait([self._staging])
            self._staging = None

    def poll(self) -> None:
        """Publish the save in flight if its write is complete (or raise its failure); never waits."""
        if self._pending is not None and self._pending.future.done():
            self.finish()

    def finish(self) -> None:
        """Wait for this rank's save in flight, if any, and publish it (rank 0)."""
        pending, self._pending = self._pending, None
        for hook in self._hooks:  # never from a hook: torch iterates an optimizer's hooks while it calls them
            hook.remove()
        self._hooks, self._staging = [], None
        if pending is not None:
            atexit.unregister(self._at_exit)
            pending.finish()

    def settle(self, barrier: Callable[[], None]) -> None:
        """Collective: once a save was started, wait until every rank's is finished and published."""
        if self._unsettled:
            self._unsettled = False
            self.finish()
            barrier()

    def close(self) -> None:
        """Wait for this rank's save in flight and publish it; then free the stager's buffers and thread."""
        try:
            self.finish()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None

    def _writers(self, t: io.Targets) -> dist.ProcessGroup | None:
        """The gloo group the writes' collectives run on: the saving ranks', made by them at the first save."""
        if not dist.is_initialized():
            return None
        if self._group is None:
            saving = t.strategy.server.checkpoint_group()
            ranks = list(range(dist.get_world_size())) if saving is None else dist.get_process_group_ranks(saving)
            self._group = dist.new_group(ranks, backend="gloo", timeout=self._timeout, use_local_synchronization=True)
        return self._group

    def _at_exit(self) -> None:
        """A script that ended without ``close``: its last save is written; publish it."""
        try:
            self.finish()
        except CheckpointError as err:
            print(f"paratrain: error: {err}", file=sys.stderr, flush=True)
