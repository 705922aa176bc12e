"""Each strategy as parallel degrees, so memory and time follow from one formula instead of a branch per name.

A ``Layout`` is a named :class:`~paratrain.dims.ParallelDims` in the planner's spelling (``dp`` replicas of which
``shard`` ranks share one copy); ``Layout.dims`` is the runtime's, and tests/test_dims.py holds every candidate
here equal to what the strategy of that name builds.

Ranks are placed as paratrain's strategies build their meshes: tensor-parallel ranks or a model-parallel
process's GPUs innermost (consecutive local GPUs), then pipeline stages (``hybrid``'s mesh is ``(dp, pp)``, with
tp ``(dp, pp, tp)``), then data parallelism; ``hsdp`` shards within a node and replicates across nodes.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from ..dims import ParallelDims
from ..errors import ConfigError
from ..model.cuts import balance
from .hardware import Cluster


@dataclass(frozen=True, kw_only=True)
class Layout:
    """A strategy as degrees: ``dp`` replicas x ``pp`` pipeline stages x ``mp`` model-parallel stages x ``tp``
    tensor-parallel ranks."""

    name: str
    """The strategy's registered name."""
    dp: int = 1
    """Data-parallel replicas: each sees different samples."""
    zero: int = 0
    """What the data-parallel ranks shard (ZeRO stage): 1 optimizer states, 2 and gradients, 3 and parameters."""
    shard: int = 1
    """Ranks one shard group spans: ``dp`` for zero1-3, a node for hsdp (replicated across nodes)."""
    pp: int = 1
    """Pipeline stages, one per process, computing different micro-batches at once."""
    mp: int = 1
    """Model-parallel stages: the GPUs of one process, holding consecutive layers and taking turns."""
    tp: int = 1
    """Tensor-parallel ranks: consecutive ranks that split every block's matrices and activations."""

    def __post_init__(self) -> None:
        if min(self.dp, self.shard, self.pp, self.mp, self.tp) < 1 or self.zero not in (0, 1, 2, 3):
            raise ConfigError(f"layout {self.name}: degrees must be >= 1 and zero in 0..3")
        if self.dp % self.shard:
            raise ConfigError(f"layout {self.name}: shard {self.shard} must divide dp {self.dp}")
        self.dims  # the runtime's own checks of the degrees (model-parallel stages do not compose with pp or tp)

    @property
    def dims(self) -> ParallelDims:
        """This layout as the runtime lays it out (``Strategy.dims``): the one definition of the degrees."""
        sharded = self.zero > 0
        return ParallelDims(dp_replicate=self.dp // self.shard if sharded else self.dp,
                            dp_shard=self.shard if sharded else 1, zero=self.zero, pp=self.pp, tp=self.tp, mp=self.mp)

    @property
    def world_size(self) -> int:
        """Devices (GPUs, or CPU processes) the layout uses."""
        return self.dp * self.pp * self.mp * self.tp

    @property
    def label(self) -> str:
        """The strategy's name, marked ``+tp`` when composed with tensor parallelism: one row of a plan each."""
        return f"{self.name}+tp" if self.tp > 1 and self.name != "tp" else self.name

    @property
    def stages(self) -> int:
        """Parts the layers are cut into."""
        return self.pp * self.mp

    @property
    def replicas(self) -> int:
        """Copies of each shard: 1 for zero3, the node count for hsdp."""
        return self.dp // self.shard

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in (("dp", self.dp), ("pp", self.pp), ("mp", self.mp)) if v > 1]
        if self.zero:
            parts.append(f"shard={self.shard}")
        if self.tp > 1:
            parts.append(f"tp={self.tp}")
        return " ".join(parts) or "1 rank"


STRATEGY_ORDER = ("single", "ddp", "zero1", "zero2", "zero3", "hsdp", "hybrid", "pipeline", "model_parallel", "tp")
"""Simplest first: when two strategies are about as fast, the earlier one is recommended (and any layout without
tensor parallelism before one with it)."""


def layouts(cluster: Cluster, n_units: int, tp_degrees: Sequence[int] = ()) -> list[Layout]:
    """Every strategy (and degree split) the cluster can run, in ``STRATEGY_ORDER``; ``single`` is one rank.

    ``hsdp`` needs several nodes of several ranks; ``hybrid`` comes in every dp x pp split with both >= 2;
    pipelines need at least as many wrap units as stages; ``model_parallel`` cuts the model over 2 or more GPUs
    of a node per process (not on a CPU host, where every stage would be the same CPU). Then, for each of
    ``tp_degrees`` that divides the ranks, the compositions paratrain's strategies offer: ``tp`` over every rank,
    or ddp, zero2, zero3, hybrid and pipeline over the groups of tp ranks.
    """
    n, per_node = cluster.world_size, cluster.ranks_per_node
    out = [Layout(name="single")]
    if n == 1:
        return out
    out += [Layout(name="ddp", dp=n), Layout(name="zero1", dp=n, zero=1, shard=n),
            Layout(name="zero2", dp=n, zero=2, shard=n), Layout(name="zero3", dp=n, zero=3, shard=n)]
    if cluster.nodes > 1 and per_node > 1:
        out.append(Layout(name="hsdp", dp=n, zero=3, shard=per_node))
    out += [Layout(name="hybrid", dp=n // pp, pp=pp) for pp in _divisors(n) if 2 <= pp <= min(n // 2, n_units)]
    if n <= n_units:
        out.append(Layout(name="pipeline", pp=n))
    if not cluster.device.shared_by_ranks:
        out += [Layout(name="model_parallel", dp=n // mp, mp=mp) for mp in _divisors(per_node) if 2 <= mp <= n_units]
    for tp in (t for t in tp_degrees if n % t == 0):
        out += _with_tp(n // tp, tp, n_units)
    return out


def _with_tp(d: int, tp: int, n_units: int) -> list[Layout]:
    """The layouts of ``d`` groups of ``tp`` tensor-parallel ranks."""
    if d == 1:
        return [Layout(name="tp", tp=tp)]
    out = [Layout(name="ddp", dp=d, tp=tp), Layout(name="zero2", dp=d, zero=2, shard=d, tp=tp),
           Layout(name="zero3", dp=d, zero=3, shard=d, tp=tp)]
    out += [Layout(name="hybrid", dp=d // pp, pp=pp, tp=tp) for pp in _divisors(d) if 2 <= pp <= min(d // 2, n_units)]
    if d <= n_units:
        out.append(Layout(name="pipeline", pp=d, tp=tp))
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@functools.lru_cache(maxsize=512)
def _runs(sizes: tuple[int, ...], stages: int) -> tuple[tuple[int, int], ...]:
    """(start, end) of each stage when ``sizes`` are cut into ``stages`` contiguous runs the way the runtime cuts a
    model (:func:`paratrain.model.cuts.balance`: the split minimising the largest stage)."""
    starts = [0, *balance(sizes, min(stages, len(sizes)))]
    return tuple(zip(starts, [*starts[1:], len(sizes)]))


def stage_params(units: tuple[tuple[str, int], ...], stages: int) -> int:
    """Parameters of the fullest stage when ``units`` are cut into ``stages`` contiguous, balanced runs."""
    sizes = tuple(s for _, s in units)
    return max(sum(sizes[a:b]) for a, b in _runs(sizes, stages))


def stage_flops(units: tuple[tuple[str, int], ...], unit_flops: tuple[float, ...], stages: int) -> float:
    """FLOPs of the busiest stage when ``units`` are cut as ``stage_params`` cuts them (balanced by parameters, as
    paratrain's pipeline cuts a model)."""
    sizes = tuple(s for _, s in units)
    return max(sum(unit_flops[a:b]) for a, b in _runs(sizes, stages))
