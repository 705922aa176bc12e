"""One benchmark job on one rank: every run of one world size, in timed blocks that take turns.

A block builds the run afresh (seeded: the same weights and data every time), warms it up, lines the ranks up
with a barrier and times ``steps`` steps one by one. Each step's time is split into the wait for the next batch
(drawing it and moving it to the device) and the rest. Then, where the strategy can leave gradient
communication out (``no_sync``), two probes of forward+backward passes, without and with synchronisation, on a
fixed batch: their difference is the communication the step waits for, and the passes without it are each
rank's own work, whose spread is the imbalance. The probes never step the optimizer, so the parameters a block
ends with are those of ``warmup + steps`` real steps. Around the timed steps each rank also reads the bytes its
strategy says it moved (``Strategy.traffic_bytes``), for the bytes per step. For a mixture of experts, the
all-to-all expert parallelism would do in a step is timed on the job's ranks (:mod:`.all_to_all`).

A strategy with serving ranks (``ps``) runs in a job of its own and is built once: its servers serve from
``prepare`` until the workers close it and then end their processes, so its rounds follow each other on the same
model, and only the workers time (and return) anything.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..distributed.process_group import finish_group, start_tool_group
from ..errors import ConfigError
from ..progress import Progress
from ..seeding import rank_seed
from ..workloads import Workload, get_workload
from .all_to_all import step_all_to_all
from .config import BenchConfig
from .machine import PeakMemory
from .subjects import ParatrainSubject, TorchDDPSubject

TORCH_DDP = "torch-ddp"


@dataclass(frozen=True, kw_only=True)
class Run:
    """One thing a job times: a paratrain strategy, or the hand-written DDP loop."""

    label: str
    strategy: str | None
    """None for the hand-written DDP loop."""
    options: dict[str, Any] = field(default_factory=dict)
    serves: bool = False
    """Some of the strategy's ranks serve instead of training: the run has its job to itself."""
    host_tensors: bool = False
    """The strategy sends host tensors through the group (:attr:`~paratrain.strategies.base.Strategy.host_tensors`):
    the job's group serves them beside the accelerator's."""


@dataclass(kw_only=True)
class Block:
    """What one rank measured in one timed block of one run."""

    step_s: list[float]
    """Each timed step, data wait included."""
    data_s: list[float]
    """The part of each step spent drawing the batch and moving it to the device."""
    synced_pass_s: float | None = None
    """Median forward+backward with gradient synchronisation (probe); None where not probed."""
    local_pass_s: float | None = None
    """Median forward+backward without it (probe)."""
    peak_bytes: int = 0
    moved_bytes: int | None = None
    """Bytes the rank sent plus received over the timed steps, as its strategy counts them (None: not counted)."""
    moving_s: float | None = None
    """Seconds of the timed steps spent in the strategy's own messages, as it times them (None: not timed)."""
    all_to_all_s: float | None = None
    """A mixture of experts: seconds per step of the all-to-alls expert parallelism would do over the job's ranks,
    timed with ``all_to_all_single`` (None: no experts, one rank, or a pipeline)."""
    all_to_all_bytes: int | None = None
    """… and the bytes each rank hands them per step."""


@dataclass(kw_only=True)
class RankRecord:
    """One rank's measurements of one run over every round."""

    label: str
    blocks: list[Block] = field(default_factory=list)
    replicas: int = 1
    replica_batch: int = 0
    memory_kind: str = ""
    error: str | None = None
    max_diff_vs_ddp: float | None = None
    """Largest |parameter difference| from paratrain's ddp block of the same round (torch-ddp only)."""


def run_job(config: BenchConfig, runs: list[Run]) -> dict[str, RankRecord]:
    """The job's body on every rank (started by ``paratrain.launch``): every round, every run, in turn."""
    device = start_tool_group(config.accelerator, any(run.host_tensors for run in runs), config.timeout_s)
    if runs[0].serves:
        records = _measure_served(config, runs[0], device)  # on a server the process ends in there
    else:
        records = _measure_all(config, runs, device)
    finish_group()  # on an error the launcher stops every rank instead
    return records


def _measure_all(config: BenchConfig, runs: list[Run], device: torch.device) -> dict[str, RankRecord]:
    workload = get_workload(config.workload)
    records = {run.label: RankRecord(label=run.label) for run in runs}
    params_by_round: dict[int, dict[str, list[torch.Tensor]]] = {}
    with Progress(config.rounds * len(runs), f"world {dist.get_world_size()}", enabled=dist.get_rank() == 0) as bar:
        for r in range(config.rounds):
            order = runs[r % len(runs) :] + runs[: r % len(runs)]
            for run in order:
                record = records[run.label]
                if record.error is None:
                    try:
                        block, params = _block(config, workload, run, device, record)
                    except ConfigError as err:  # raised alike on every rank: skip this run, keep the others
                        record.error = str(err)
                    else:
                        record.blocks.append(block)
                        if params is not None:
                            params_by_round.setdefault(r, {})[run.label] = params
                bar.update()
    if TORCH_DDP in records and "ddp" in records:
        diffs = [_max_diff(p["ddp"], p[TORCH_DDP]) for p in params_by_round.values() if len(p) == 2]
        records[TORCH_DDP].max_diff_vs_ddp = max(diffs) if diffs else None
    return records


def _measure_served(config: BenchConfig, run: Run, device: torch.device) -> dict[str, RankRecord]:
    """A strategy with serving ranks: built once, then ``rounds`` timed blocks in a row on its workers."""
    workload = get_workload(config.workload)
    record = RankRecord(label=run.label)
    memory = PeakMemory(device)
    gc.collect()
    memory.start()
    try:
        subject = _subject(config, workload, run, device)  # a server serves in here, then its process ends
    except ConfigError as err:
        record.error = str(err)
        return {run.label: record}
    with Progress(config.rounds, f"world {dist.get_world_size()}", enabled=dist.get_rank() == 0) as bar:
        for r in range(config.rounds):
            if r:
                gc.collect()
                memory.start()
            record.blocks.append(_timed(config, workload, subject, record, memory))
            bar.update()
    subject.close()
    return {run.label: record}


def _subject(
    config: BenchConfig, workload: Workload, run: Run, device: torch.device
) -> ParatrainSubject | TorchDDPSubject:
    if run.strategy is None:
        return TorchDDPSubject(workload, config.seed, device)
    return ParatrainSubject(workload, run.strategy, run.options, config.seed, config.accelerator)


def _block(
    config: BenchConfig, workload: Workload, run: Run, device: torch.device, record: RankRecord
) -> tuple[Block, list[torch.Tensor] | None]:
    memory = PeakMemory(device)
    gc.collect()
    memory.start()
    subject = _subject(config, workload, run, device)
    block = _timed(config, workload, subject, record, memory)
    if isinstance(subject, ParatrainSubject):
        block.all_to_all_s, block.all_to_all_bytes = _all_to_all(config, workload, subject)
    kept = None
    if config.compare and run.label in ("ddp", TORCH_DDP):  # plain replicas: no gathering needed
        kept = [p.detach().cpu().clone() for p in subject.model.parameters()]
    subject.close()
    del subject
    return block, kept


def _timed(
    config: BenchConfig,
    workload: Workload,
    subject: ParatrainSubject | TorchDDPSubject,
    record: RankRecord,
    memory: PeakMemory,
) -> Block:
    """Warm-up, then the timed steps, then the probes, on one built subject."""
    batch = config.replica_batch(subject.replicas)
    record.replicas, record.replica_batch, record.memory_kind = subject.replicas, batch, memory.kind
    data = torch.Generator().manual_seed(rank_seed(config.seed, subject.replica_rank))
    sync = _synchronizer(subject.device)

    def timed_step() -> tuple[float, float]:
        t0 = time.perf_counter()
        x, y = workload.batch(batch, data, subject.device)
        t1 = time.perf_counter()
        subject.step(x, y)
        sync()
        return time.perf_counter() - t0, t1 - t0

    for _ in range(config.warmup):
        timed_step()
    subject.barrier()
    before, before_s = subject.bytes_moved(), subject.seconds_moving()
    steps, waits = zip(*(timed_step() for _ in range(config.steps)))
    after, after_s = subject.bytes_moved(), subject.seconds_moving()
    block = Block(
        step_s=list(steps),
        data_s=list(waits),
        moved_bytes=None if before is None or after is None else after - before,
        moving_s=None if before_s is None or after_s is None else after_s - before_s,
    )
    if config.comm_probe and subject.can_skip_sync:
        assert isinstance(subject, ParatrainSubject)
        block.local_pass_s, block.synced_pass_s = _probe(subject, workload, batch, config, sync)
    block.peak_bytes = memory.peak_bytes()
    return block


def _all_to_all(config: BenchConfig, workload: Workload, subject: ParatrainSubject) -> tuple[float | None, int | None]:
    """The step's expert all-to-all (:func:`.all_to_all.step_all_to_all`) on one batch, when the model has experts
    and every rank holds all of them (not a pipeline's stages)."""
    from ..distributed.pipeline import PipelinedModel

    if isinstance(subject.model, PipelinedModel):
        return None, None
    g = torch.Generator().manual_seed(rank_seed(config.seed + 2, subject.replica_rank))
    x, _ = workload.batch(config.replica_batch(subject.replicas), g, subject.device)
    measured = step_all_to_all(subject.model, lambda: subject.model(x), subject.device)
    return (None, None) if measured is None else measured


def _probe(
    subject: ParatrainSubject, workload: Workload, batch: int, config: BenchConfig, sync: Any
) -> tuple[float, float]:
    """(median pass without gradient sync, median pass with it), on a fixed batch; no optimizer step."""
    g = torch.Generator().manual_seed(rank_seed(config.seed + 1, subject.replica_rank))
    x, y = workload.batch(batch, g, subject.device)
    passes = max(config.steps // 2, 3)
    medians = []
    for synced in (False, True):  # without first: FSDP's held-back gradients go out in the first synced pass
        subject.forward_backward(x, y, sync=synced)  # one untimed pass to settle
        dist.barrier()
        times = []
        for _ in range(passes):
            t0 = time.perf_counter()
            subject.forward_backward(x, y, sync=synced)
            sync()
            times.append(time.perf_counter() - t0)
        medians.append(statistics.median(times))
    return medians[0], medians[1]


def _synchronizer(device: torch.device):
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((float((p.double() - q.double()).abs().max()) for p, q in zip(a, b)), default=0.0)
