"""The parallel half of verify, on every rank: build the user's setup, run their loop, gather the evidence.

Several cases (factory x strategy) run one after the other in the same processes, on one process group.
The loop runs until the optimizer has stepped ``steps`` times; a hook after that step stops it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data.distributed import DistributedSampler

from ..data import ShardSampler, describe_sampler
from ..digest import state_digest
from ..distributed.process_group import finish_group, start_tool_group
from ..distributed.router_loss import router_loss
from ..errors import ConfigError
from ..parallel import Parallel
from .floor import Rounding, compute_rounding
from .options import merged_strategy_options
from .record import Record, RecordHooks, recording_loader, run_loop
from .spec import VerifySpec, build_spec

MAX_DEFAULT_STEPS = 50
FED_DEFAULT_STEPS = 10
"""Steps compared by default when the loop reads from something other than the spec's loader (no epochs to count)."""


@dataclass(frozen=True, kw_only=True)
class Case:
    """One check: a factory's setup trained with one strategy."""

    factory: str
    """``module:function`` returning a ``VerifySpec``."""
    strategy: str
    options: dict[str, Any] = field(default_factory=dict)
    """Strategy options from the command (``--tp``), passed to ``Parallel`` with the spec's own."""
    steps: int | None = None
    """Optimizer steps to compare; None: two epochs' worth, at most 50."""


@dataclass(kw_only=True)
class DataSetup:
    """How the data should be split, as a distributed sampler would split it."""

    size: int
    micro_batch: int
    shuffle: bool
    drop_last: bool
    seed: int
    replicas: int
    """Data-parallel replicas."""

    @property
    def per_replica(self) -> int:
        """Samples each replica reads per epoch."""
        return ShardSampler(
            range(self.size), num_replicas=self.replicas, rank=0, shuffle=False, drop_last=self.drop_last
        ).num_samples

    def steps_per_epoch(self, accumulate: int) -> float:
        per_rank = self.per_replica
        batches = per_rank // self.micro_batch if self.drop_last else math.ceil(per_rank / self.micro_batch)
        return batches / accumulate


@dataclass(kw_only=True)
class RankEvidence:
    """What one rank brings back from one case."""

    case: Case
    error: str | None = None
    record: Record = field(default_factory=Record)
    init_digest: str = ""
    init_state: dict[str, torch.Tensor] | None = None
    """The model's state before ``prepare`` (rank 0 only): the reference starts from it."""
    final_digest: str = ""
    """Digest of this rank's own full state at the end."""
    fetched: list[int] = field(default_factory=list)
    """Sample indices this rank's loader fetched, in order."""
    replica: int = 0
    """This rank's data-parallel index."""
    data: DataSetup | None = None
    """How the spec's loader would be split (None without one)."""
    replicas: int = 1
    """Data-parallel replicas."""
    accumulate: int = 1
    steps: int = 0
    """Steps asked for (the record holds how many ran)."""
    options: dict[str, str] = field(default_factory=dict)
    """The options the parallel run got besides the strategy (``repr`` of each value), for the report."""
    rounding: Rounding = field(default_factory=Rounding)
    """What its precision rounds beyond the measured floor (:func:`~paratrain.verify.floor.compute_rounding`)."""
    router_loss: str | None = None
    """How the model adds a router load-balancing loss that each rank computes on its own slice (no
    ``moe_aux_loss="global"``), in words; None when it adds none or the option makes it the global batch's."""


def run_cases(cases: list[Case], timeout_s: float, accelerator: str = "auto") -> list[RankEvidence]:
    """The job's body on every rank (started by ``paratrain.launch``). A case's options are known only once its
    factory has run, after the group is up, so the group serves host tensors (CPU offload) whatever they ask."""
    start_tool_group(accelerator, host_tensors=True, timeout_s=timeout_s)
    out = []
    for case in cases:
        evidence = RankEvidence(case=case)
        try:
            _run_case(case, evidence, accelerator)
        except ConfigError as err:  # raised alike on every rank (bad setup): report it, go on with the next case
            evidence.error = str(err)
        out.append(evidence)
        dist.barrier()
    finish_group()
    return out


def _run_case(case: Case, ev: RankEvidence, accelerator: str) -> None:
    spec = build_spec(case.factory)
    ev.init_digest = state_digest(spec.model)
    rank = dist.get_rank()
    if rank == 0:
        ev.init_state = {k: v.detach().cpu().clone() for k, v in spec.model.state_dict().items()}
    recorder = RecordHooks(spec.model, own_loss=spec.loss is None)
    strategy_options = case_options(case, spec)
    ev.options = spec.run_options.described(strategy_options)
    ev.router_loss = router_loss(spec.model) if strategy_options.get("moe_aux_loss", "local") == "local" else None
    par = Parallel(
        case.strategy,
        accelerator=accelerator,
        monitor=False,  # the monitor's table would only add noise
        **spec.run_options.parallel(spec.accumulate, micro_batch(spec)),
        **strategy_options,
    )
    loader, recording = recording_loader(spec.loader) if spec.loader is not None else (None, None)
    model, optimizer = par.prepare(spec.model, spec.build_optimizer())
    ev.replica, ev.replicas = par.data_parallel_rank, par.data_parallel_size
    ev.rounding = compute_rounding(par.precision)
    ev.accumulate = par.accumulate  # a global batch is resolved by prepare
    ev.data = _data_setup(spec.loader, par)

    def steps() -> int:  # known once the loop has shown whether it reads the spec's loader
        if case.steps:
            return case.steps
        read = ev.data is not None and recording is not None and recording.fetched
        return _default_steps(ev.data, ev.accumulate) if read else FED_DEFAULT_STEPS

    run_loop(spec, par, model, optimizer, loader, recorder, steps, keep_states=rank == 0)
    ev.steps = steps()
    ev.data = _data_setup(spec.loader, par)  # again: the loop may have seeded the data order
    ev.record, ev.fetched = recorder.record, recording.fetched if recording is not None else []
    if ev.fetched:  # the reference reads the spec's loader: what the model was fed is not replayed
        ev.record.inputs, ev.record.targets, ev.record.first_call, ev.record.first_targets = [], [], None, None
    ev.final_digest = state_digest(par.full_state_dict(model, rank0_only=False))
    par.close()


def case_options(case: Case, spec: VerifySpec) -> dict[str, Any]:
    """The strategy options of ``case``: the spec's with the command's."""
    return merged_strategy_options(spec.run_options.strategy, case.options)


def micro_batch(spec: VerifySpec) -> int | None:
    """The per-rank micro-batch: the spec's loader's batch size (None without a loader)."""
    return spec.loader.batch_size if spec.loader is not None else None


def _data_setup(loader: Any, par: Parallel) -> DataSetup | None:
    if loader is None:
        return None
    shuffle, batch, drop_last = describe_sampler(loader)
    own = loader.sampler if isinstance(loader.sampler, DistributedSampler) else None
    seed = own.seed if own is not None else par.data_seed
    setup = DataSetup(
        size=len(loader.dataset),
        micro_batch=batch,
        shuffle=shuffle,
        drop_last=drop_last,
        seed=seed,
        replicas=par.data_parallel_size,
    )
    if not drop_last and setup.size % setup.replicas:
        raise ConfigError(
            f"verify: the dataset has {setup.size} samples, not a multiple of the {setup.replicas} "
            "data-parallel ranks, so a distributed sampler repeats samples that one process never reads; "
            "use drop_last=True or a dataset size divisible by the ranks"
        )
    return setup


def _default_steps(data: DataSetup, accumulate: int) -> int:
    """Two epochs (so a missing reshuffle shows), at most ``MAX_DEFAULT_STEPS``."""
    return max(1, min(MAX_DEFAULT_STEPS, int(2 * data.steps_per_epoch(accumulate))))
