"""``Monitor``: the per-rank recorder, one small all-gather every ``every`` optimizer steps (and, for a mixture of
experts, one all-reduce of its tokens per expert), the rules on the gathered figures, warnings and the window's
figures to the logs and trackers on rank 0, and the end-of-run table.

Every rank reaches the gather at the same optimizer-step count (the counter advances in ``Parallel.step`` on
all ranks alike), so it cannot deadlock a job that trains; it waits no longer than the process group's timeout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from ..env import cpu_count
from .config import MonitorConfig
from .experts import ExpertCounter, ExpertLoad, expert_figures, find_routing_collapse
from .figures import job_figures, rank_figures
from .recorder import SYNC_POINTS, Recorder
from .report import CsvLog, RunSummary
from .rules import Finding, Persistence, RankStats, find_all
from .trackers import Trackers


class _Block:
    """The context ``Parallel.step`` wraps around the user's block (reused; no allocation per step)."""

    __slots__ = ("rec", "sync")

    def __init__(self, rec: Recorder) -> None:
        self.rec, self.sync = rec, False

    def __enter__(self) -> None:
        pass

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.rec.end(self.sync)


class Monitor:
    """Watches one rank's training; ``Parallel`` owns one (``par.monitor``) unless ``monitor=False``.

    Args:
        config: thresholds, window size, logs.
        rank, world_size, local_world_size: where this process sits.
        device: the rank's device (where the gather's tensor lives: a GPU for NCCL).
        peer: ranks with equal ``peer`` do the same work and are compared (a pipeline's stage index).
        emit: writes a warning line (rank 0 only calls it).
        accumulate: micro-batches per optimizer step, for the table's header.
        group: the ranks that compare notes (None: every rank; a parameter server's workers).
        trackers: where rank 0 sends the job's figures of each window, beside the script's ``par.log``.
        replicas: how many of the ranks read different data (asked at each window: ``auto`` decides it late).
        same_tokens: how many ranks route the same tokens (a tensor-parallel group; asked at each window): the
            ranks of a cp group read the same samples but route different slices of them.
        peak_flops: one device's peak FLOP/s, for MFU (None: unknown).
    """

    def __init__(
        self,
        config: MonitorConfig,
        *,
        rank: int,
        world_size: int,
        local_world_size: int,
        device: torch.device,
        peer: int = 0,
        emit: Callable[[str], None] = print,
        accumulate: int = 1,
        group: dist.ProcessGroup | None = None,
        trackers: Trackers | None = None,
        replicas: Callable[[], int] = lambda: 1,
        same_tokens: Callable[[], int] = lambda: 1,
        peak_flops: float | None = None,
    ) -> None:
        self.config = config
        self.group = group
        self.trackers = trackers if trackers is not None and trackers.active else None
        self.replicas, self.same_tokens, self.peak_flops = replicas, same_tokens, peak_flops
        self.rank, self.world_size, self.local_world_size = rank, world_size, local_world_size
        self.device, self.peer, self.emit, self.accumulate = device, peer, emit, accumulate
        # every rank counts its batches when the job is tracked: rank 0 reports their mean over the ranks
        self.recorder = Recorder(
            device, track_arrival=world_size > 1, counting=trackers is not None and trackers.config is not None
        )
        self.warnings: list[Finding] = []
        """Warnings raised so far (the same list on every rank)."""
        self.last_window: list[RankStats] = []
        """Every rank's figures over the last window."""
        self.experts = ExpertCounter(device) if config.experts else None
        self.expert_loads: list[ExpertLoad] = []
        """Each MoE layer's tokens per expert over the last window, every data-parallel rank's (the same on all)."""
        self.skipped_steps = 0
        """Optimizer steps the numerics guard skipped (:mod:`paratrain.guard`; the same on every rank)."""
        self._persistence = Persistence(config.persist)
        self._block = _Block(self.recorder)
        on_rank0 = rank == 0
        self._csv = CsvLog(config.csv) if on_rank0 and config.csv is not None else None
        self._closed = False

    # ----------------------------------------------------------------- hooks called by Parallel
    def wrap_loader(self, loader: DataLoader) -> DataLoader:
        """Time the loader's ``__next__`` (the same object is returned, its batches unchanged)."""
        return self.recorder.wrap_loader(loader)

    def block(self, model: nn.Module, sync: bool) -> _Block:
        """Context for one micro-step's block."""
        self.recorder.begin(model, sync)
        if self.experts is not None:
            self.experts.watch(model)
        self._block.sync = sync
        return self._block

    def stepped(self, step: int | None = None) -> None:
        """The optimizer stepped: every ``every`` steps, gather the window and apply the rules. ``step``: the job's
        optimizer step count, the logs' step axis (``Parallel`` passes ``par.optimizer_steps``, which a resume
        restores); by default the steps this monitor has seen."""
        self.recorder.stepped()
        if self.recorder.steps % self.config.every == 0:
            self._window(self.recorder.steps if step is None else step)

    # ----------------------------------------------------------------- windows
    def _window(self, step: int) -> None:
        stats = self._gather(self.recorder.window(self.rank, self.peer))
        self.last_window = stats
        loads = self._expert_window()
        due = self._persistence.update(
            [
                *find_all(stats, self.config, sync_point=self.sync_point_label, data_advice=self._data_advice()),
                *find_routing_collapse(loads, self.config),
            ]
        )
        self.warnings.extend(due)
        if self.rank == 0:
            for finding in due:
                self.emit(f"paratrain monitor: {finding.message}")
            self._log(step, stats, loads)

    def _log(self, step: int, stats: list[RankStats], loads: list[ExpertLoad]) -> None:
        if self._csv is not None:
            self._csv.write(step, stats)
        if self.trackers is not None:
            figures = job_figures(
                stats,
                replicas=self.replicas(),
                flops_per_sample=self.config.flops_per_sample,
                peak_flops=self.peak_flops,
            )
            per_rank = rank_figures(stats) if self.config.per_rank else {}
            self.trackers.log({**figures, **per_rank, **expert_figures(loads)}, step)

    def _expert_window(self) -> list[ExpertLoad]:
        """Tokens per expert since the last window, over the training ranks (each token once); kept as
        ``expert_loads`` unless nothing was routed since (a second ``summary``)."""
        if self.experts is None:
            return []
        loads = self.experts.window(self.group, copies=self.same_tokens())
        if any(x.total for x in loads):
            self.expert_loads = loads
        return loads

    def _gather(self, mine: RankStats) -> list[RankStats]:
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1):
            return [mine]
        t = torch.tensor(mine.to_list(), dtype=torch.float64, device=self.device)
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, t, group=self.group)
        return [RankStats.from_list(p.tolist()) for p in parts]

    @property
    def sync_point_label(self) -> str:
        return SYNC_POINTS[self.recorder.sync_point]

    def _data_advice(self) -> str:
        loader = self.recorder.current_loader
        if loader is None:
            return ""
        cores = max(cpu_count() // max(self.local_world_size, 1), 1)
        tips = []
        if loader.num_workers == 0:
            tips.append(
                f"load in background processes with DataLoader(num_workers={max(min(cores - 1, 8), 1)}) "
                f"(now 0; {cores} core(s) per rank here)"
            )
        else:
            tips.append(f"raise num_workers (now {loader.num_workers}; {cores} core(s) per rank here)")
            if not loader.persistent_workers:
                tips.append("set persistent_workers=True (workers restart every epoch)")
        if self.recorder.cuda and not loader.pin_memory:
            tips.append("set pin_memory=True and copy with .to(device, non_blocking=True)")
        tips.append("or make __getitem__ cheaper (decode and resize once, ahead of time)")
        return "; ".join(tips)

    # ----------------------------------------------------------------- the end
    def summary(self) -> RunSummary:
        """The whole run per rank (a collective: call it on every rank, like ``close``)."""
        rows = self._gather(self.recorder.run(self.rank, self.peer))
        self._expert_window()
        return RunSummary(
            rows=rows,
            warnings=list(self.warnings),
            sync_point=self.sync_point_label,
            memory="peak alloc" if self.recorder.cuda else "peak RSS",
            every=self.config.every,
            accumulate=self.accumulate,
            experts=list(self.expert_loads),
            skipped_steps=self.skipped_steps,
        )

    def close(self, print_fn: Callable[[str], Any] = print) -> RunSummary | None:
        """Print the summary table on rank 0 (unless ``summary=False``), close the logs, remove the hooks."""
        if self._closed:
            return None
        self._closed = True
        summary = self.summary() if self.config.summary else None
        if summary is not None and self.rank == 0 and self.recorder.steps > 1:  # a step's time needs the one before
            print_fn(summary.table())
        if self._csv is not None:
            self._csv.close()
        self.recorder.close()
        if self.experts is not None:
            self.experts.close()
        return summary
