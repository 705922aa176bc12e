"""One rank's timings: step time, time waiting for data, time to reach the sync point, peak memory.

Timeline of one optimizer step on one rank (accumulated micro-steps included)::

    previous sync done ── data ── forward ── backward ──┤ sync point ├── wait + comm ── sync done
    └──────────────────── busy: this rank's own time ───┘

All ranks leave a gradient sync together, so the rank that reaches the next one last (largest *busy*) is
the one the others wait for; its wall step time is the same as theirs. Where the first blocking collective of
a step sits depends on the wrapper (:func:`sync_point_of`). On CUDA, busy is measured with CUDA events on the
current stream (a GPU that computes slowly shows up); the rest with the host clock.

The hot path is a few clock reads per step: one hook on the model (the parameter whose gradient is produced
last, learned on the first step, or a forward pre-hook) and a wrapper around the prepared loaders' iterator, which
in a tracked job also counts each batch's samples and tokens (for throughput and MFU).
"""

from __future__ import annotations

import resource
import statistics
import sys
from collections.abc import Iterator, Mapping
from time import perf_counter
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from .rules import RankStats

SYNC_POINTS = {
    "grads": "the gradient sync (end of its backward)",
    "forward": "the first collective of its forward (parameter all-gather, buffer broadcast or tensor-parallel "
    "all-reduce)",
    "step": "the start of its step (pipeline stages also wait for each other inside the step)",
    "none": "the end of its step (one process: no sync)",
}


def sync_point_of(model: nn.Module) -> str:
    """Where a step of ``model`` first blocks on the other ranks: ``"grads"``, ``"forward"`` or ``"step"``."""
    from ..distributed.pipeline import PipelinedModel

    if isinstance(model, PipelinedModel):
        return "step"  # later stages wait for activations from the very first micro-batch
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6 kept it under _composable
        from torch.distributed._composable.fsdp import FSDPModule  # type: ignore[no-redef]
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        return "forward"  # parameters are all-gathered before the first layer runs
    if _tensor_parallel(model):
        return "forward"  # the tp group all-reduces inside the forward: a rank arriving there waits for the others
    buffers = getattr(model, "forward_sync_buffers", getattr(model, "broadcast_buffers", False))
    if buffers and len(getattr(model, "modules_buffers", ())) > 0:
        return "forward"  # DDP broadcasts buffers (BatchNorm statistics) at every forward
    return "grads"


def _tensor_parallel(model: nn.Module) -> bool:
    """Parameters split or replicated over a mesh of more than one rank: tensor parallelism's collectives run inside
    the forward and backward, so time up to the gradient sync would count waiting for the tp group as busy."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) and p.device_mesh.size() > 1 for p in model.parameters())


class _TimedIterator:
    """The loader's own iterator, timing each ``__next__``; yields exactly what the loader yields."""

    __slots__ = ("_it", "_rec")

    def __init__(self, it: Iterator[Any], rec: Recorder) -> None:
        self._it, self._rec = it, rec

    def __iter__(self) -> _TimedIterator:
        return self

    def __next__(self) -> Any:
        t0 = perf_counter()
        try:
            batch = next(self._it)
        finally:  # the pass's last call, which raises StopIteration, counts too (workers shutting down)
            self._rec.data_s += perf_counter() - t0
        if self._rec.counting:
            self._rec.count(batch)
        return batch

    def __len__(self) -> int:
        return len(self._it)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._it, name)


class _Untimed:
    """Work a loader runs inside ``__next__`` that is not loading data (``ShardedLoader.before_fetch``: a pending
    checkpoint is saved there); its time is taken back out of the data wait."""

    __slots__ = ("fn", "rec")

    def __init__(self, fn: Any, rec: Recorder) -> None:
        self.fn, self.rec = fn, rec

    def __call__(self) -> None:
        t0 = perf_counter()
        self.fn()
        self.rec.data_s -= perf_counter() - t0


def _timed_subclass(base: type[DataLoader]) -> type[DataLoader]:
    class Timed(base):  # type: ignore[valid-type, misc]
        def __iter__(self) -> Iterator[Any]:
            it = super().__iter__()
            rec = self.__dict__.get("_paratrain_recorder")
            if rec is None:
                return it
            rec.current_loader = self
            return _TimedIterator(it, rec)

        def __reduce_ex__(self, protocol: Any) -> Any:  # copies and pickles are the plain, unmonitored loader
            state = {k: v for k, v in self.__dict__.items() if k != "_paratrain_recorder"}
            return _restore, (base, state)

    Timed.__name__, Timed.__qualname__, Timed.__module__ = base.__name__, base.__qualname__, base.__module__
    return Timed


TOKEN_DTYPES = (torch.int64, torch.int32)


def batch_size_of(batch: Any) -> tuple[int, int]:
    """(samples, tokens) in one batch, read from its first tensor: the batch itself, a tuple's or list's first item,
    a mapping's ``input_ids`` (else its first value). Samples: that tensor's first dimension. Tokens: its elements
    when it is a 2-D int64/int32 tensor (token ids, batch x sequence), else 0: images and features have none."""
    for _ in range(3):  # (x, y), {"input_ids": x}, ((x, mask), y): deep enough for the batches loaders yield
        if isinstance(batch, torch.Tensor):
            if batch.dim() == 0:
                return 0, 0
            tokens = batch.numel() if batch.dim() == 2 and batch.dtype in TOKEN_DTYPES else 0
            return batch.shape[0], tokens
        if isinstance(batch, (tuple, list)) and batch:
            batch = batch[0]
        elif isinstance(batch, Mapping):
            batch = batch["input_ids"] if "input_ids" in batch else next(iter(batch.values()), None)
        else:
            break
    return 0, 0


def _restore(cls: type, state: dict[str, Any]) -> Any:
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    return obj


def peak_host_rss() -> float:
    """This process's resident-set high-water mark in bytes (-1 where the OS does not say)."""
    try:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except (AttributeError, OSError):
        return -1.0
    return float(rss if sys.platform == "darwin" else rss * 1024)


class Recorder:
    """Collects one rank's figures; ``window()`` summarises the steps since the last call by medians."""

    def __init__(self, device: torch.device, *, track_arrival: bool = True, counting: bool = False) -> None:
        self.device = device
        self.counting = counting
        """Count each batch's samples and tokens (for the trackers' throughput; off, the figures stay 0)."""
        self.cuda = device.type == "cuda"
        self.track_arrival = track_arrival
        self.sync_point = "grads" if track_arrival else "none"
        self.data_s = 0.0
        self.samples = self.tokens = 0
        self.current_loader: DataLoader | None = None
        self.steps = 0
        self._sync = False
        self._depart: tuple[float, Any] | None = None  # (host time, device mark) when the last sync finished
        self._arrive: Any = None
        # (step s, data s, samples, tokens, depart mark, arrive mark) of each step since the last window
        self._pending: list[tuple[float, float, int, int, Any, Any]] = []
        self._windows: list[tuple[float, ...]] = []  # per-window medians: step, busy, data (ms), samples, tokens
        self._hooked: dict[int, list[Any]] = {}  # id(model) -> hook handles
        self._grad_handles: list[Any] = []
        self._last_grad: int | None = None
        self._learning = False
        self._classes: dict[type, type] = {}
        self._device_used = -1.0

    # ----------------------------------------------------------------- marks
    def _mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))  # this rank's GPU, whatever the current device
            return event
        return perf_counter()

    def _elapsed_ms(self, start: Any, end: Any) -> float:
        if self.cuda:
            end.synchronize()
            start.synchronize()
            return start.elapsed_time(end)
        return (end - start) * 1e3

    # ----------------------------------------------------------------- loaders
    def count(self, batch: Any) -> None:
        """A prepared loader yielded ``batch``."""
        samples, tokens = batch_size_of(batch)
        self.samples += samples
        self.tokens += tokens

    def wrap_loader(self, loader: DataLoader) -> DataLoader:
        """Time ``loader``'s ``__next__`` in place: same object, same batches, ``len`` and ``sampler``; its class
        becomes a subclass of the original one that wraps the iterator."""
        cls = type(loader)
        if cls not in self._classes.values():
            if cls not in self._classes:
                self._classes[cls] = _timed_subclass(cls)
            loader.__class__ = self._classes[cls]
        loader.__dict__["_paratrain_recorder"] = self
        before = loader.__dict__.get("before_fetch")
        if callable(before) and not isinstance(before, _Untimed):
            loader.before_fetch = _Untimed(before, self)  # type: ignore[attr-defined]
        return loader

    # ----------------------------------------------------------------- model hooks
    def _hook(self, model: nn.Module) -> None:
        if id(model) in self._hooked:
            return
        handles: list[Any] = []
        self._hooked[id(model)] = handles
        if not self.track_arrival:
            return
        self.sync_point = sync_point_of(model)
        if self.sync_point == "forward":
            handles.append(model.register_forward_pre_hook(self._on_forward, prepend=True))
        elif self.sync_point == "grads":
            params = [p for p in model.parameters() if p.requires_grad]
            self._grad_handles = [
                p.register_post_accumulate_grad_hook(self._grad_hook(i)) for i, p in enumerate(params)
            ]
            handles.extend(self._grad_handles)
            self._learning = True

    def _grad_hook(self, index: int) -> Any:
        def hook(_param: torch.Tensor) -> None:
            if self._sync:
                self._last_grad = index
                if not self._learning:
                    self._arrive = self._mark()

        return hook

    def _on_forward(self, _module: nn.Module, _args: Any) -> None:
        if self._arrive is None and torch.is_grad_enabled():  # evaluation forwards do not count
            self._arrive = self._mark()

    def _learned(self) -> None:
        """After the first synchronised backward keep only the hook of the parameter whose gradient came last."""
        self._learning = False
        for i, handle in enumerate(self._grad_handles):
            if i != self._last_grad:
                handle.remove()

    # ----------------------------------------------------------------- the step
    def begin(self, model: nn.Module, sync: bool) -> None:
        """A micro-step's block starts."""
        self._hook(model)
        self._sync = sync
        if self.sync_point == "step" and self._arrive is None:
            self._arrive = self._mark()

    def end(self, sync: bool) -> None:
        """A micro-step's block ended cleanly; on the last micro-step the gradients are synchronised now."""
        self._sync = False
        if not sync:
            return
        now = perf_counter()
        mark = self._mark() if self.cuda else now
        if self._depart is not None:
            self._pending.append(
                (
                    now - self._depart[0],
                    self.data_s,
                    self.samples,
                    self.tokens,
                    self._depart[1],
                    self._arrive if self._arrive is not None else mark,
                )
            )
        if self._learning:
            self._learned()
        self._depart = (now, mark)
        self._arrive = None
        self.data_s = 0.0
        self.samples = self.tokens = 0

    def stepped(self) -> None:
        """The optimizer stepped."""
        self.steps += 1

    # ----------------------------------------------------------------- summaries
    def window(self, rank: int, peer: int) -> RankStats:
        """Medians over the steps since the last window, and the memory high-water marks so far."""
        steps = len(self._pending)
        if steps:
            pending = self._pending
            columns = (
                [p[0] * 1e3 for p in pending],
                [self._elapsed_ms(p[4], p[5]) for p in pending],
                [p[1] * 1e3 for p in pending],
                [p[2] for p in pending],
                [p[3] for p in pending],
            )
            self._windows.append(tuple(float(statistics.median(c)) for c in columns))
        self._pending.clear()
        return self._stats(rank, peer, steps, self._windows[-1] if steps else (0.0,) * 5)

    def run(self, rank: int, peer: int) -> RankStats:
        """Medians of the window medians over the whole run (the unfinished window counted as one)."""
        if self._pending:
            self.window(rank, peer)
        if not self._windows:
            return self._stats(rank, peer, self.steps, (0.0,) * 5)
        return self._stats(
            rank, peer, self.steps, tuple(statistics.median(w[i] for w in self._windows) for i in range(5))
        )

    def _stats(self, rank: int, peer: int, steps: int, medians: tuple[float, ...]) -> RankStats:
        step, busy, data, samples, tokens = medians
        peak, used = self._memory()
        return RankStats(rank, peer, steps, step, busy, data, peak, used, samples, tokens)

    def _memory(self) -> tuple[float, float]:
        """(peak bytes of this process, bytes in use on its GPU by every process or -1)."""
        if not self.cuda:
            return peak_host_rss(), -1.0
        free, total = torch.cuda.mem_get_info(self.device)
        self._device_used = max(self._device_used, float(total - free))
        return float(torch.cuda.max_memory_allocated(self.device)), self._device_used

    def close(self) -> None:
        """Remove the hooks from the models."""
        for handles in self._hooked.values():
            for handle in handles:
                handle.remove()
        self._hooked.clear()
