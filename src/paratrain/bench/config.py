"""What ``paratrain bench`` runs: one validated, keyword-only configuration."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..composition import PIPELINES
from ..errors import ConfigError
from ..options import SCHEDULES

SCALING = ("weak", "strong")
COMPARE = ("torch-ddp",)
BASELINE = "single"
"""The strategy of the world-1 run every speedup is measured against."""


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """A benchmark: one workload at several world sizes and strategies."""

    workload: str = "mlp"
    """A built-in workload (mlp, cnn, gpt-tiny, gpt-moe-tiny, recommender, recommender-tiny) or ``module:factory``."""
    nprocs: tuple[int, ...] = (1, 2)
    """World sizes to run; world 1 (the baseline) is always added."""
    strategies: tuple[str, ...] = ("ddp",)
    """Strategies to run at each world size above 1 (world 1 runs 'single')."""
    strategy_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Options per strategy name, passed to ``Parallel`` (e.g. ``{"pipeline": {"microbatches": 8}}``)."""
    schedules: tuple[str, ...] = ()
    """Pipeline schedules each pipeline strategy (``pipeline``, ``hybrid``) is timed under, side by side in the same
    job (``--schedules 1f1b,zbv``): a row each, labelled ``pipeline/zbv``; empty: the strategy's own schedule."""
    tp: int | None = None
    """Tensor-parallel degree inside ddp, zero2 and zero3 (``--tp``); the ``tp`` strategy splits over every rank.
    Models without a built-in plan use the workload's ``tp_plan``."""
    servers: int | None = None
    """Ranks that serve in a strategy that has servers (ps's ``servers``, ``--ps-servers``; None: its default, 1).
    They take no step: such a strategy's rows time its workers (see docs/bench.md)."""
    scaling: str = "weak"
    """``weak``: ``batch`` samples per replica at every size; ``strong``: ``batch`` samples per step in total."""
    batch: int = 64
    """Samples per replica (weak scaling) or per optimizer step (strong scaling)."""
    warmup: int = 5
    """Untimed steps before every timed block."""
    steps: int = 20
    """Timed steps per block."""
    rounds: int = 5
    """Blocks per configuration; the configurations of a job take turns, in a rotating order."""
    compare: str | None = None
    """``torch-ddp``: also time a hand-written DDP loop on the same workload, interleaved with paratrain's ddp."""
    threads: bool = False
    """Also run one process with k times the threads of a rank, for every world size k above 1."""
    threads_per_rank: int | None = None
    """Intra-op threads of every rank; default: cores divided by the largest world size (at least 1)."""
    accelerator: str = "auto"
    """``auto`` (GPUs when present), ``cpu`` or ``cuda``."""
    comm_probe: bool = True
    """Measure the communication share and the imbalance with extra forward+backward passes (see docs/bench.md)."""
    seed: int = 0
    """Seeds the model initialisation and the data."""
    timeout_s: float = 900.0
    """A job (one world size) that runs longer is stopped."""

    def __post_init__(self) -> None:
        from ..devices import ACCELERATORS
        from ..strategies import check_name

        if not self.nprocs or any(not isinstance(n, int) or n < 1 for n in self.nprocs):
            raise ConfigError(f"nprocs must be world sizes >= 1, got {self.nprocs!r}")
        object.__setattr__(self, "nprocs", tuple(sorted({1, *self.nprocs})))
        if not self.strategies:
            raise ConfigError("give at least one strategy")
        for name in self.strategies:
            check_name(name)
        if len(set(self.strategies)) != len(self.strategies):
            raise ConfigError(f"a strategy is named twice in {list(self.strategies)}")
        for name in self.strategy_options:
            if name not in self.strategies:
                raise ConfigError(f"options given for strategy {name!r}, which is not among {list(self.strategies)}")
        unknown = [s for s in self.schedules if s not in SCHEDULES]
        if unknown or len(set(self.schedules)) != len(self.schedules):
            raise ConfigError(f"schedules must be distinct names among {', '.join(SCHEDULES)}, got {self.schedules}")
        if self.schedules and not set(self.strategies) & set(PIPELINES):
            raise ConfigError("--schedules times the pipeline strategies; add pipeline or hybrid to the strategies")
        if self.servers is not None and (not isinstance(self.servers, int) or self.servers < 1):
            raise ConfigError(f"servers must be >= 1, got {self.servers!r}")
        if self.scaling not in SCALING:
            raise ConfigError(f"scaling must be one of {', '.join(SCALING)}, got {self.scaling!r}")
        for name in ("batch", "steps", "rounds"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ConfigError(f"warmup must be >= 0, got {self.warmup}")
        if self.compare is not None:
            if self.compare not in COMPARE:
                raise ConfigError(f"unknown comparison {self.compare!r}; choose one of: {', '.join(COMPARE)}")
            if "ddp" not in self.strategies:
                raise ConfigError("--compare torch-ddp times paratrain's ddp against it; add ddp to the strategies")
        if self.threads_per_rank is not None and self.threads_per_rank < 1:
            raise ConfigError(f"threads_per_rank must be >= 1, got {self.threads_per_rank}")
        if self.accelerator not in ACCELERATORS:
            raise ConfigError(f"unknown accelerator {self.accelerator!r}; choose one of {', '.join(ACCELERATORS)}")
        if self.timeout_s <= 0:
            raise ConfigError(f"timeout_s must be > 0, got {self.timeout_s}")

    def rank_threads(self, cores: int) -> int:
        """Threads every rank gets: the same at each world size, so a rank is the same 'device' everywhere."""
        return self.threads_per_rank or max(1, cores // max(self.nprocs))

    def replica_batch(self, replicas: int) -> int:
        """Samples each data-parallel replica reads per step (one of a world's ``replicas``)."""
        if self.scaling == "weak":
            return self.batch
        if self.batch % replicas:
            raise ConfigError(
                f"strong scaling splits batch {self.batch} over {replicas} replicas; use a multiple of {replicas}"
            )
        return self.batch // replicas
