"""The options of each parallel technique, as typed, keyword-only dataclasses validated on construction.

They sit at the bottom of the package (beside :mod:`paratrain.dims`) so that strategies, the free functions of
:mod:`paratrain.distributed` and the planner all read one definition; nothing here imports torch.distributed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from .composition import CP_METHODS, ZERO_BUBBLE, refuse_degree
from .errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

COMM_HOOKS = ("fp16", "bf16", "powersgd")
"""DDP's gradient-compression hooks by name (:mod:`paratrain.distributed.comm_hooks`)."""
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", *ZERO_BUBBLE)
"""Pipeline schedules by name."""
MULTI_STAGE = ("interleaved-1f1b", "interleaved-zb")
"""Schedules that run two or more stages per rank, placed in a loop (rank r: stages r, r + p, …)."""
V_SHAPED = ("zbv", "dualpipev")
"""Schedules that run exactly two stages per rank, placed in a V (rank r: stages r and 2p - 1 - r)."""


def stages_per_rank_of(schedule: str, given: int | None) -> int:
    """The stages each rank holds under ``schedule`` (``given``: asked for, None for its default); one-line
    ``ConfigError`` when the schedule cannot run that many."""
    default = 2 if schedule in MULTI_STAGE + V_SHAPED else 1
    v = default if given is None else given
    if schedule in MULTI_STAGE and v < 2:
        raise ConfigError(f"the {schedule} schedule needs stages_per_rank >= 2")
    if schedule in V_SHAPED and v != 2:
        raise ConfigError(f"the {schedule} schedule runs exactly 2 stages per rank (a V), got stages_per_rank={v}")
    if schedule not in MULTI_STAGE + V_SHAPED and v != 1:
        raise ConfigError(f"schedule {schedule!r} runs one stage per rank; use interleaved-1f1b for more")
    return v


def stages_of(schedule: str, pp_rank: int, pp: int, per_rank: int) -> list[int]:
    """The stage indices pipeline rank ``pp_rank`` of ``pp`` holds: a V (``zbv``, ``dualpipev``: stages r and
    2p - 1 - r, so the first and last stages share rank 0) or a loop (r, r + p, …), as torch's schedules place them."""
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(per_rank)]


def check_microbatches(schedule: str, microbatches: int, pp: int, stages: int) -> None:
    """One-line ``ConfigError`` where torch's ``schedule`` cannot run ``microbatches`` over ``pp`` ranks holding
    ``stages`` stages: DualPipeV needs one per stage at least; the interleaved ones run them in rounds of
    m // p, which must divide m."""
    if schedule == "dualpipev" and microbatches < stages:
        raise ConfigError(
            f"the dualpipev schedule needs at least as many micro-batches as stages ({stages}), got microbatches="
            f"{microbatches}; raise microbatches to {stages} or more"
        )
    rounds = max(1, microbatches // pp)
    if schedule in MULTI_STAGE and microbatches % rounds:
        raise ConfigError(
            f"the {schedule} schedule runs its micro-batches in {rounds} equal rounds over {pp} ranks, which "
            f"microbatches={microbatches} does not make; use a multiple of {pp} (or fewer than {2 * pp})"
        )


def rank_of_stage(schedule: str, stage: int, pp: int) -> int:
    """The pipeline rank holding ``stage`` (the inverse of :func:`stages_of`)."""
    if schedule in V_SHAPED and stage >= pp:
        return 2 * pp - 1 - stage
    return stage % pp


@dataclass(kw_only=True)
class DDPConfig:
    """Options passed to ``DistributedDataParallel``."""

    bucket_cap_mb: float = 25.0
    """Gradient bucket size; larger buckets mean fewer, bigger all-reduces."""
    find_unused_parameters: bool = False
    """Walk the autograd graph each step to find parameters that got no gradient (slower)."""
    static_graph: bool = False
    """The graph is the same every step: lets DDP skip per-step bookkeeping."""
    gradient_as_bucket_view: bool = False
    """Gradients alias the communication buckets: saves one gradient-sized copy of memory."""
    broadcast_buffers: bool = True
    """Broadcast rank 0's buffers (e.g. BatchNorm statistics) at every forward."""
    comm_hook: str | None = None
    """Gradient compression: ``fp16``, ``bf16`` or ``powersgd`` (see ``paratrain.distributed.comm_hooks``)."""
    powersgd_rank: int = 1
    """Rank of PowerSGD's low-rank approximation (higher: more accurate, more traffic)."""
    powersgd_start_iter: int = 10
    """Optimizer steps of exact all-reduce before PowerSGD compression starts."""

    def __post_init__(self) -> None:
        if self.bucket_cap_mb <= 0:
            raise ConfigError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb}")
        if self.comm_hook is not None and self.comm_hook not in COMM_HOOKS:
            raise ConfigError(f"unknown comm_hook {self.comm_hook!r}; choose one of: {', '.join(COMM_HOOKS)}")
        if self.powersgd_rank < 1:
            raise ConfigError(f"powersgd_rank must be >= 1, got {self.powersgd_rank}")


@dataclass(kw_only=True)
class FSDPConfig:
    """How the model is cut into sharding units and when parameters are re-sharded."""

    reshard_after_forward: bool = True
    """Free gathered parameters after each unit's forward (ZeRO-3) or keep them until backward (ZeRO-2)."""
    wrap_classes: Sequence[type[nn.Module]] = ()
    """Module classes that each become a unit; empty: the model's repeated blocks (transformer blocks)."""
    min_params: int = 100_000
    """Outside those units (and in models without blocks) a sub-module becomes a unit when it holds at least this
    many parameters that no smaller unit already took."""
    shard_size: int | None = None
    """hsdp only: ranks per shard group (default: processes per node, or half the world on one node)."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in host memory."""

    def __post_init__(self) -> None:
        if self.min_params < 1:
            raise ConfigError(f"min_params must be >= 1, got {self.min_params}")
        for cls in self.wrap_classes:
            if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
                raise ConfigError(f"wrap_classes must hold nn.Module classes, got {cls!r}")


@dataclass(kw_only=True)
class PipelineConfig:
    """How the model is cut and scheduled."""

    schedule: str = "1f1b"
    """``gpipe``, ``1f1b``, ``interleaved-1f1b``, or a zero-bubble schedule that splits each backward into its input
    and weight gradients: ``interleaved-zb`` (looped stages), ``zbv`` or ``dualpipev`` (two stages per rank in a V)."""
    microbatches: int = 4
    """Micro-batches per batch; the batch size must divide by it."""
    split: Sequence[int] | None = None
    """Indices where stages 2, 3, … begin (of an ``nn.Sequential``'s layers, or of a model's blocks); None:
    balance by parameter count."""
    split_points: Sequence[str] | None = None
    """Names of the modules where stages 2, 3, … begin (``["transformer.h.6"]``; an ``nn.Sequential``'s are
    ``"0"``, ``"1"``, …); instead of ``split``."""
    stages_per_rank: int | None = None
    """Stages each rank holds (default 1; 2 for the interleaved schedules; exactly 2 for ``zbv`` and ``dualpipev``)."""
    dp: int | None = None
    """hybrid only: data-parallel degree (default: half the processes, so 4 processes = 2 x 2)."""
    data: str = "ddp"
    """hybrid only: the data engine that lays each stage out across ``dp``, that of the preset of this name: ``ddp``,
    ``zero1`` (DDP, with the optimizer's states sharded by ``ZeroRedundancyOptimizer``: Megatron-DeepSpeed's ZeRO-1
    across a pp x tp layout's replicas) or ``zero3`` (FSDP2's sharding; also spelled ``fsdp``)."""
    eval_outputs: str = "every"
    """Who gets a forward-only call's output (``model(x)``): ``every`` rank of the pipeline, or the ``last``
    stage's ranks alone; the others then get the loss the model computed (``out.loss``, no logits), or None."""

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"unknown pipeline schedule {self.schedule!r}; choose one of: {', '.join(SCHEDULES)}")
        if self.microbatches < 1:
            raise ConfigError(f"microbatches must be >= 1, got {self.microbatches}")
        self.stages_per_rank = stages_per_rank_of(self.schedule, self.stages_per_rank)
        if self.eval_outputs not in ("every", "last"):
            raise ConfigError(f"eval_outputs must be 'every' or 'last', got {self.eval_outputs!r}")
        if self.data not in ("ddp", "zero1", "zero3", "fsdp"):
            raise ConfigError(f"hybrid data must be 'ddp', 'zero1' or 'zero3' (or 'fsdp'), got {self.data!r}")
        if self.split is not None and self.split_points is not None:
            raise ConfigError("give either split (indices) or split_points (module names), not both")
        if isinstance(self.split_points, str):
            self.split_points = [self.split_points]


@dataclass(kw_only=True)
class ModelParallelConfig:
    """Where the model is cut."""

    split: Sequence[int] | None = None
    """Layer indices where stages 2, 3, … begin (see ``layers()``); None: balance by parameter count."""
    stages: int | None = None
    """Number of stages when balancing (default: the GPUs per process, or 2 on the CPU)."""

    def __post_init__(self) -> None:
        if self.stages is not None and self.stages < 1:
            raise ConfigError(f"stages must be >= 1, got {self.stages}")


def check_degree(option: str, degree: object, meaning: str) -> None:
    """One line unless ``degree`` (the strategy option ``option``: ``tp``, ``cp``, ``ep``) is a whole number >= 1."""
    if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
        raise ConfigError(f"{option} must be an integer >= 1 ({meaning}), got {degree!r}")


@dataclass(frozen=True, kw_only=True)
class TPConfig:
    """Tensor parallelism as a strategy option."""

    degree: int | None = None
    """Ranks that split each layer (``tp=``); None: every rank (the ``tp`` strategy)."""
    plan: Mapping[str, str | ParallelStyle] | str | None = None
    """Module-name patterns → styles (``tp_plan=``), or ``"auto"`` (a plan inferred from the model's blocks);
    None: the model's built-in plan, else an inferred one."""

    def __post_init__(self) -> None:
        if self.degree is not None:
            check_degree("tp", self.degree, "ranks that split each layer")
        if isinstance(self.plan, str) and self.plan != "auto":
            raise ConfigError(f"tp_plan must be 'auto' or a dict of module-name patterns to styles, not {self.plan!r}")

    @classmethod
    def pop(cls, options: dict[str, Any]) -> TPConfig | None:
        """The ``tp``/``tp_plan`` options taken out of a strategy's options; None when tensor parallelism is off."""
        degree, plan = options.pop("tp", None), options.pop("tp_plan", None)
        if degree in (None, 1) and plan is None:
            return None
        if degree is None:
            raise ConfigError("tp_plan given without tp; say how many ranks split each layer, e.g. tp=2")
        return cls(degree=degree, plan=plan)


@dataclass(frozen=True, kw_only=True)
class CPConfig:
    """Context parallelism as a strategy option (``cp=``): each sequence split over ``degree`` ranks."""

    degree: int
    """Ranks that each hold 1/degree of every sequence of the same samples."""
    method: str = "auto"
    """How attention sees whole sequences (``cp_method=``, :data:`~paratrain.composition.CP_METHODS`): ``ulysses``
    (an all-to-all trades the sequence split for a head split), ``allgather`` (keys and values gathered, any head
    count) or ``auto`` (Ulysses where the heads divide by tp x cp)."""

    def __post_init__(self) -> None:
        check_degree("cp", self.degree, "ranks that split each sequence")
        if self.method not in CP_METHODS:
            raise ConfigError(f"cp_method must be one of {', '.join(CP_METHODS)}, got {self.method!r}")

    @classmethod
    def pop(cls, options: dict[str, Any]) -> CPConfig | None:
        """The ``cp`` and ``cp_method`` options taken out of a strategy's options; None when context parallelism is
        off (a ``cp_method`` without ``cp`` is one line)."""
        degree, method = options.pop("cp", None), options.pop("cp_method", None)
        if degree in (None, 1):
            if method is not None and degree is None:
                raise ConfigError(f"cp_method={method!r} chooses how cp runs attention; add cp=N (ranks a sequence)")
            return None
        return cls(degree=degree, method="auto" if method is None else method)


@dataclass(frozen=True, kw_only=True)
class EPConfig:
    """Expert parallelism as a strategy option (``ep=``)."""

    degree: int
    """Data-parallel ranks that split every mixture-of-experts layer's routed experts between them."""

    def __post_init__(self) -> None:
        check_degree("ep", self.degree, "ranks that split each layer's experts")

    @classmethod
    def pop(cls, options: dict[str, Any], strategy: str, takes_ep: bool) -> EPConfig | None:
        """The ``ep`` option taken out of a strategy's options; None when expert parallelism is off; one line for a
        strategy that cannot hold it."""
        degree = options.pop("ep", None)
        if degree in (None, 1):
            return None
        config = cls(degree=degree)
        if not takes_ep:
            raise ConfigError(refuse_degree(strategy, "ep", degree))
        return config


@dataclass(frozen=True, kw_only=True)
class BlockTransforms:
    """What happens to each repeated block before data parallelism wraps it (:mod:`paratrain.model.transforms`)."""

    checkpoint_every: int = 0
    """Recompute every k-th block in backward instead of keeping its activations (0: off)."""
    compile: Mapping[str, Any] | None = None
    """``torch.compile`` options of each block (or of the whole model without blocks); None: not compiled."""

    @classmethod
    def of(cls, activation_checkpointing: bool | int, compile: bool | Mapping[str, Any]) -> BlockTransforms:
        """From ``Parallel``'s ``activation_checkpointing=`` (True, False or k) and ``compile=`` (True, False or a
        dict of ``torch.compile`` options); a bad value is one line."""
        every = activation_checkpointing
        if every is False or every is None:
            every = 0
        elif every is True:
            every = 1
        elif not isinstance(every, int) or every < 1:
            raise ConfigError(
                f"activation_checkpointing must be True, False or k >= 1 (every k-th block), got "
                f"{activation_checkpointing!r}"
            )
        if not isinstance(compile, (bool, Mapping)):
            raise ConfigError(f"compile must be True, False or a dict of torch.compile options, got {compile!r}")
        options = dict(compile) if isinstance(compile, Mapping) else {} if compile else None
        return cls(checkpoint_every=every, compile=options)
