"""Each strategy as parallel degrees, so memory and time follow from one formula instead of a branch per name.

A ``Layout`` is a named :class:`~paratrain.dims.ParallelDims` in the planner's spelling (``dp`` replicas of which
``shard`` ranks share one copy); ``Layout.dims`` is the runtime's, and tests/strategies/test_dims.py holds every
candidate here equal to what the strategy of that name builds.

Ranks are placed as paratrain's strategies build their meshes: tensor-parallel ranks or a model-parallel
process's GPUs innermost (consecutive local GPUs), then pipeline stages (``hybrid``'s mesh is ``(dp, pp)``, with
tp ``(dp, pp, tp)``), then data parallelism; ``hsdp`` shards within a node and replicates across nodes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..composition import refusal, takes
from ..dims import ParallelDims
from ..errors import ConfigError
from ..model.cuts import balance
from .hardware import Cluster


@dataclass(frozen=True)
class Layout:
    """A strategy as the planner plans it: its registered name, its degrees as the runtime lays them out
    (:class:`~paratrain.dims.ParallelDims`, the one definition), and parameter servers beside them. The planner's
    spelling of the degrees — ``dp`` replicas of which ``shard`` ranks share one copy — is read from ``dims``."""

    name: str
    """The strategy's registered name."""
    dims: ParallelDims = ParallelDims()
    """The degrees. A parameter server's job is one flat data-parallel dimension over every rank, servers included,
    as ``ps`` builds it: its servers take part in none of that mesh's collectives (they answer point-to-point
    messages), so the degrees have no dimension of their own for them."""
    servers: int = 0
    """Parameter servers (``ps``): ranks beside the ``dp`` workers that hold the parameters, their optimizer and the
    embedding tables, and compute nothing."""

    @classmethod
    def of(
        cls,
        name: str,
        *,
        dp: int = 1,
        zero: int = 0,
        shard: int = 1,
        pp: int = 1,
        mp: int = 1,
        tp: int = 1,
        ep: int = 1,
        cp: int = 1,
        servers: int = 0,
    ) -> Layout:
        """A layout in the planner's spelling: ``dp`` data-parallel replicas (workers, beside ``servers``) of which
        ``shard`` ranks share one copy at ZeRO stage ``zero``; ``pp`` pipeline stages, ``mp`` model-parallel stages
        of one process, ``tp`` tensor-parallel ranks, ``ep`` of the data-parallel ranks splitting the experts,
        ``cp`` context-parallel ranks per replica splitting its sequences (they join the shard group)."""
        if min(dp, shard, pp, mp, tp, ep, cp) < 1 or zero not in (0, 1, 2, 3):
            raise ConfigError(f"layout {name}: degrees must be >= 1 and zero in 0..3")
        if servers < 0 or (servers and (zero or pp * mp > 1 or tp > 1 or ep > 1 or cp > 1)):
            raise ConfigError(f"layout {name}: parameter servers serve plain data-parallel workers")
        if dp % shard:
            raise ConfigError(f"layout {name}: shard {shard} must divide dp {dp}")
        if servers:
            return cls(name=name, dims=ParallelDims(dp_replicate=dp + servers), servers=servers)
        return cls(
            name=name,
            dims=ParallelDims(
                dp_replicate=dp // shard if zero else dp,
                dp_shard=shard if zero else 1,
                zero=zero,
                pp=pp,
                tp=tp,
                mp=mp,
                ep=ep,
                cp=cp,
            ),
            servers=servers,
        )

    @property
    def dp(self) -> int:
        """Data-parallel replicas: each sees different samples (a parameter server's workers)."""
        return self.dims.dp - self.servers

    @property
    def zero(self) -> int:
        """What the data-parallel ranks shard (ZeRO stage): 1 optimizer states, 2 and gradients, 3 and parameters."""
        return self.dims.zero

    @property
    def shard(self) -> int:
        """Ranks one shard group spans: ``dp`` for zero1-3, a node for hsdp (replicated across nodes)."""
        return self.dims.dp_shard if self.dims.zero else 1

    @property
    def pp(self) -> int:
        """Pipeline stages, one per process, computing different micro-batches at once."""
        return self.dims.pp

    @property
    def mp(self) -> int:
        """Model-parallel stages: the GPUs of one process, holding consecutive layers and taking turns."""
        return self.dims.mp

    @property
    def tp(self) -> int:
        """Tensor-parallel ranks: consecutive ranks that split every block's matrices and activations."""
        return self.dims.tp

    @property
    def ep(self) -> int:
        """Expert-parallel ranks: data-parallel ranks that each hold 1/ep of every MoE block's experts."""
        return self.dims.ep

    @property
    def cp(self) -> int:
        """Context-parallel ranks: ranks of one replica that each hold 1/cp of every sequence of its samples."""
        return self.dims.cp

    @property
    def shard_ranks(self) -> int:
        """Ranks one copy of the model states is sharded over under ZeRO: the shard group and its cp ranks (1
        without ZeRO)."""
        return self.shard * self.cp if self.zero else 1

    @property
    def grad_ranks(self) -> int:
        """Ranks whose gradients are reduced together: the data-parallel replicas and their cp ranks (dp x cp)."""
        return self.dp * self.cp

    def degrees(self) -> dict[str, int]:
        """The degrees in the planner's spelling (a plan's JSON): ``shard`` the data-parallel ranks sharing one copy,
        which ZeRO shards over them and their cp ranks (``shard_ranks``, what ``describe`` shows as shard=)."""
        return {
            "dp": self.dp,
            "zero": self.zero,
            "shard": self.shard,
            "pp": self.pp,
            "mp": self.mp,
            "tp": self.tp,
            "ep": self.ep,
            "cp": self.cp,
            "servers": self.servers,
        }

    @property
    def world_size(self) -> int:
        """Devices (GPUs, or CPU processes) the layout uses."""
        return self.dp * self.pp * self.mp * self.tp * self.cp + self.servers

    @property
    def label(self) -> str:
        """The strategy's name, marked with how ``hybrid`` holds its stages across its replicas when it shards them
        (``+zero1``, ``+fsdp``), ``+tp`` when composed with tensor parallelism, ``+ep`` with expert parallelism and
        ``+cp`` with context parallelism: one row of a plan each."""
        name = self.name + (_HYBRID_DATA[self.zero] if self.name == "hybrid" and self.zero else "")
        name = f"{name}+tp" if self.tp > 1 and self.name != "tp" else name
        name = f"{name}+ep" if self.ep > 1 else name
        return f"{name}+cp" if self.cp > 1 else name

    @property
    def stages(self) -> int:
        """Parts the layers are cut into."""
        return self.pp * self.mp

    @property
    def replicas(self) -> int:
        """Copies of each shard: 1 for zero3, the node count for hsdp."""
        return self.dims.dp_replicate

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in (("dp", self.dp), ("pp", self.pp), ("mp", self.mp)) if v > 1]
        if self.zero:
            parts.append(f"shard={self.shard_ranks}")
        if self.tp > 1:
            parts.append(f"tp={self.tp}")
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        if self.cp > 1:
            parts.append(f"cp={self.cp}")
        if self.servers:
            parts = [f"workers={self.dp}", f"servers={self.servers}"]
        return " ".join(parts) or "1 rank"


_HYBRID_DATA = {1: "+zero1", 3: "+fsdp"}
"""``hybrid``'s ``data=`` options that shard, by ZeRO stage (``ddp`` replicates)."""

STRATEGY_ORDER = (
    "single",
    "ddp",
    "zero1",
    "zero2",
    "zero3",
    "hsdp",
    "hybrid",
    "pipeline",
    "model_parallel",
    "tp",
    "ps",
)
"""Simplest first: when two strategies are about as fast, the earlier one is recommended (and any layout without
tensor parallelism before one with it). ``ps`` last: a process more per server, and the one strategy that is not
the same collectives on every rank."""


def layouts(
    cluster: Cluster,
    n_units: int,
    tp_degrees: Sequence[int] = (),
    ps_servers: int = 0,
    ep_degrees: Sequence[int] = (),
    cp_pairs: Sequence[tuple[int, int]] = (),
) -> list[Layout]:
    """Every strategy (and degree split) the cluster can run, in ``STRATEGY_ORDER``; ``single`` is one rank.

    ``hsdp`` needs several nodes of several ranks; ``hybrid`` comes in every dp x pp split with both >= 2, its
    stages replicated by DDP or, as ``data="zero1"`` runs it, with their optimizer states sharded over dp (ZeRO-1);
    pipelines need at least as many wrap units as stages; ``model_parallel`` cuts the model over 2 or more GPUs
    of a node per process (not on a CPU host, where every stage would be the same CPU). Then, for each of
    ``tp_degrees`` that divides the ranks, the compositions paratrain's strategies offer: ``tp`` over every rank,
    or ddp, zero2, zero3, hybrid and pipeline over the groups of tp ranks. Then, for each of ``ep_degrees`` (a
    mixture of experts'), the layouts whose data-parallel ranks holding one copy it divides, with expert
    parallelism: ddp, zero2 and zero3, alone and with each tp degree, and ``hybrid`` replicating its
    stages by DDP (each stage's experts split over ep of its dp replicas; not with tp, not ZeRO-1, whose optimizer
    cannot hold split experts' states, and not ``pipeline``, which has no replicas). Then, for each (tp, cp) of
    ``cp_pairs`` whose tp x cp divides the ranks, the data-parallel layouts over the groups of tp x cp ranks (cp
    outside tp, as the mesh lays them) of the presets that take cp, their shard group joined by the cp ranks (not
    pipelines, not hsdp). Last, with ``ps_servers`` S > 0 and more ranks than that, ``ps``: S servers and the other
    ranks as workers. Every layout is one the runtime builds (``composes``: the table of
    :mod:`paratrain.composition`).
    """
    n, per_node = cluster.world_size, cluster.ranks_per_node
    out = [Layout.of(name="single")]
    if n == 1:
        return out
    out += [
        Layout.of(name="ddp", dp=n),
        Layout.of(name="zero1", dp=n, zero=1, shard=n),
        Layout.of(name="zero2", dp=n, zero=2, shard=n),
        Layout.of(name="zero3", dp=n, zero=3, shard=n),
    ]
    if cluster.nodes > 1 and per_node > 1:
        out.append(Layout.of(name="hsdp", dp=n, zero=3, shard=per_node))
    out += _hybrids(n, 1, n_units)
    if n <= n_units:
        out.append(Layout.of(name="pipeline", pp=n))
    if not cluster.device.shared_by_ranks:
        out += [Layout.of(name="model_parallel", dp=n // mp, mp=mp) for mp in _divisors(per_node) if 2 <= mp <= n_units]
    for tp in (t for t in tp_degrees if n % t == 0):
        out += _with_tp(n // tp, tp, n_units)
    for ep in ep_degrees:
        out += _with_ep([lay for lay in out if _takes_ep(lay)], ep)
    for tp, cp in (pair for pair in cp_pairs if n % (pair[0] * pair[1]) == 0):
        out += _with_cp(n // (tp * cp), tp, cp)
    if 0 < ps_servers < n:
        out.append(Layout.of(name="ps", dp=n - ps_servers, servers=ps_servers))
    return [lay for lay in out if composes(lay)]


def composes(layout: Layout, schedule: str = "1f1b") -> bool:
    """Whether ``layout``'s strategy takes its tp, cp and ep together, its pipeline under ``schedule``
    (:func:`paratrain.composition.refusal`): the runtime's own rule, so that no layout is planned that the runtime
    refuses."""
    data = _DATA[layout.zero]
    return refusal(layout.name, tp=layout.tp, cp=layout.cp, ep=layout.ep, data=data, schedule=schedule) is None


LAYOUT_STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "hsdp", "hybrid")
"""The strategies ``--layout`` may name (``zero3,cp=2``, ``hybrid,pp=2,ep=2``): the ways of running a data-parallel
group, and ``hybrid`` to tell its pipeline from them."""


def layout_strategy(text: str | None) -> str | None:
    """The strategy ``--layout zero3,cp=2`` names (its part without ``=``), or None: every way of running it."""
    named = [part for part in (text or "").replace(" ", "").split(",") if part in LAYOUT_STRATEGIES]
    return named[0] if named else None


def exact_layout(
    text: str | None = None,
    *,
    dp: int | None = None,
    pp: int | None = None,
    tp: int | None = None,
    ep: int | None = None,
    cp: int | None = None,
    world: int | None = None,
) -> ParallelDims | None:
    """The degrees ``--layout dp=8,pp=12,tp=4`` (or ``--dp``/``--pp`` with ``--tp``, ``--ep``, ``--cp``) pin, or
    None: search. ``ep`` is carved out of dp (``dp=8,ep=8``: 8 ranks); ``cp`` multiplies the ranks
    (``dp=4,cp=2``: 8 ranks, 4 replicas of 2 ranks splitting each sequence). A layout that names its strategy
    (``zero3,cp=2``, see ``layout_strategy``) may leave dp out: the ``world`` ranks the other degrees leave.

    ``--tp``, ``--ep`` or ``--cp`` alone keeps the search (over that degree), as ``--tp`` always has."""
    if text is None and dp is None and pp is None:
        return None
    degrees = {"dp": dp, "pp": pp, "tp": tp, "ep": ep, "cp": cp}
    if text is not None:
        if dp is not None or pp is not None:
            raise ConfigError("give the layout once: --layout dp=..,pp=..,tp=.. or --dp/--pp/--tp, not both")
        for part in text.replace(" ", "").split(","):
            key, _, value = part.partition("=")
            if key in LAYOUT_STRATEGIES and not value:
                continue
            if key not in degrees or not value.isdigit():
                raise ConfigError(
                    f"--layout {text!r}: cannot read {part!r}; write degrees as dp=8,pp=12,tp=4 "
                    "(keys dp, pp, tp, ep, cp; the ones left out are 1), optionally with one of "
                    f"{', '.join(LAYOUT_STRATEGIES)} (zero3,cp=2)"
                )
            given = {"tp": tp, "ep": ep, "cp": cp}.get(key)
            if given is not None and given != int(value):
                raise ConfigError(f"--layout says {key}={value} but --{key} {given}; give the degree once")
            degrees[key] = int(value)
        if layout_strategy(text) == "hybrid" and (degrees["pp"] or 1) < 2:
            raise ConfigError(
                f"--layout {text!r}: hybrid is a pipeline replicated over dp; give its stages too (hybrid,pp=2,ep=2)"
            )
        if degrees["dp"] is None and world is not None and layout_strategy(text) is not None:
            rest = math.prod(v or 1 for k, v in degrees.items() if k in ("pp", "tp", "cp"))
            degrees["dp"] = max(1, world // rest)
    return ParallelDims(**{"dp_replicate" if k == "dp" else k: 1 if v is None else v for k, v in degrees.items()})


def exact_layouts(cluster: Cluster, n_units: int, dims: ParallelDims, strategy: str | None = None) -> list[Layout]:
    """``single`` and the layouts with exactly ``dims``' degrees (``ParallelDims.dp``, ``pp``, ``tp``, ``ep``,
    ``cp``): one, or for a data-parallel group without pipeline stages each way of running it (ddp, zero1-3, hsdp,
    as ``layouts`` offers them), which the plan compares; only ``strategy``'s when named. One-line errors for
    degrees the cluster or the model cannot take."""
    given = (
        f"dp={dims.dp} x pp={dims.pp}"
        + (f" x cp={dims.cp}" if dims.cp > 1 else "")
        + f" x tp={dims.tp}"
        + (f" (ep={dims.ep})" if dims.ep > 1 else "")
    )
    if dims.world_size != cluster.world_size:
        raise ConfigError(
            f"the layout {given} needs {dims.world_size} GPUs but the cluster has "
            f"{cluster.world_size} ({cluster.ranks_per_node} per node x {cluster.nodes} nodes); "
            "change the degrees or --gpus/--nodes so that dp x pp x cp x tp equals the GPUs"
        )
    if dims.cp > 1 and (dims.pp > 1 or dims.ep > 1):
        raise ConfigError(
            f"the layout {given}: context parallelism is planned with data and tensor parallelism "
            "only; drop pp and ep, or cp"
        )
    if dims.pp > 1 and dims.ep > 1 and dims.tp > 1:
        raise ConfigError(
            f"the layout {given}: a pipeline's experts are planned split over its dp replicas without "
            "tp (Parallel('hybrid', dp=D, ep=E)); drop tp or ep"
        )
    found = [
        lay
        for lay in layouts(
            cluster,
            n_units,
            (dims.tp,) if dims.tp > 1 else (),
            ep_degrees=(dims.ep,) if dims.ep > 1 else (),
            cp_pairs=((dims.tp, dims.cp),) if dims.cp > 1 else (),
        )
        if (lay.dims.dp, lay.pp, lay.tp, lay.mp, lay.ep, lay.cp) == (dims.dp, dims.pp, dims.tp, 1, dims.ep, dims.cp)
    ]
    if not found:  # a degree split the search leaves out, e.g. a pipeline of 2 stages replicated once
        raise ConfigError(
            f"the layout {given} is not one paratrain's strategies build on {cluster.world_size} "
            "GPUs; change the degrees"
        )
    if strategy is not None and all(lay.name != strategy for lay in found):
        raise ConfigError(
            f"the layout {given} is not planned as {strategy}; name one of "
            f"{', '.join(sorted({lay.name for lay in found}))} or none (all of them)"
        )
    return [Layout.of(name="single"), *(lay for lay in found if lay.name != "single" and strategy in (None, lay.name))]


DATA_PARALLEL = ("ddp", "zero1", "zero2", "zero3")
"""The data-parallel presets by ZeRO stage, 0 to 3."""

EP_STRATEGIES = tuple(name for name in DATA_PARALLEL if takes(name).ep)
"""The strategies planned with expert parallelism over their data-parallel ranks, alone or over groups of tp ranks
(the presets that take ``ep=``, :data:`paratrain.composition.TAKES`); ``hybrid`` too, over each stage's replicas
(``_takes_ep``)."""

_DATA = {0: "ddp", 1: "zero1", 2: "zero2", 3: "fsdp"}
"""A layout's data engine by ZeRO stage, as a pipeline's ``data=`` names it."""


def _takes_ep(layout: Layout) -> bool:
    """Whether ``layout`` is planned with expert parallelism: a data-parallel strategy without stages, or a
    ``hybrid`` whose stages DDP replicates, without tp (what ``Parallel("hybrid", dp=D, ep=E)`` builds)."""
    if layout.name == "hybrid":
        return layout.zero == 0 and layout.tp == 1
    return layout.name in EP_STRATEGIES and layout.pp == 1


def _with_ep(data_parallel: list[Layout], ep: int) -> list[Layout]:
    """``data_parallel``'s layouts with ``ep`` of the ranks holding one copy splitting the experts, where it
    divides them (``ParallelDims.ep``)."""
    out = []
    for lay in data_parallel:
        group = lay.shard if lay.zero else lay.dp
        if group % ep == 0 and group > 1:
            out.append(Layout.of(name=lay.name, dp=lay.dp, zero=lay.zero, shard=lay.shard, pp=lay.pp, tp=lay.tp, ep=ep))
    return out


def _with_cp(d: int, tp: int, cp: int) -> list[Layout]:
    """The data-parallel layouts of ``d`` replicas of ``cp`` x ``tp`` ranks, of the presets that take cp (ZeRO-1
    without tp, as ``_with_tp``)."""
    return [
        Layout.of(name=name, dp=d, zero=z, shard=d if z else 1, tp=tp, cp=cp)
        for z, name in enumerate(DATA_PARALLEL)
        if takes(name).cp and (z != 1 or tp == 1)
    ]


def _with_tp(d: int, tp: int, n_units: int) -> list[Layout]:
    """The layouts of ``d`` groups of ``tp`` tensor-parallel ranks."""
    if d == 1:
        return [Layout.of(name="tp", tp=tp)]
    out = [
        Layout.of(name="ddp", dp=d, tp=tp),
        Layout.of(name="zero2", dp=d, zero=2, shard=d, tp=tp),
        Layout.of(name="zero3", dp=d, zero=3, shard=d, tp=tp),
    ]
    out += _hybrids(d, tp, n_units)
    if d <= n_units:
        out.append(Layout.of(name="pipeline", pp=d, tp=tp))
    return out


def _hybrids(d: int, tp: int, n_units: int) -> list[Layout]:
    """``hybrid`` over ``d`` groups of ``tp`` ranks: every dp x pp split with both >= 2, replicated by DDP or with the
    optimizer states sharded over dp (ZeRO-1)."""
    splits = [(d // pp, pp) for pp in _divisors(d) if 2 <= pp <= min(d // 2, n_units)]
    return [
        Layout.of(name="hybrid", dp=dp, pp=pp, tp=tp, **sharded)
        for dp, pp in splits
        for sharded in ({}, {"zero": 1, "shard": dp})
    ]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@functools.lru_cache(maxsize=512)
def _runs(sizes: tuple[int, ...], stages: int) -> tuple[tuple[int, int], ...]:
    """(start, end) of each stage when ``sizes`` are cut into ``stages`` contiguous runs the way the runtime cuts a
    model (:func:`paratrain.model.cuts.balance`: the split minimising the largest stage)."""
    starts = [0, *balance(sizes, min(stages, len(sizes)))]
    return tuple(zip(starts, [*starts[1:], len(sizes)]))


def fullest_stage(
    units: tuple[tuple[str, int], ...], stages: int, *, between_blocks: bool = False, copy: int = 0
) -> tuple[int, int, int]:
    """(first unit, end, parameters) of the fullest stage when ``units`` are cut into ``stages`` contiguous,
    balanced runs, or, ``between_blocks``, when a pipeline cuts only between the blocks (``units`` = embedding,
    blocks…, head; the blocks balanced as the runtime balances them): the embedding on the first stage, the head and
    ``copy`` (a tied embedding's second copy) on the last."""
    sizes = tuple(s for _, s in units)
    if between_blocks:
        spans = [(a + 1, b + 1) for a, b in _runs(sizes[1:-1], stages)]
        spans[0], spans[-1] = (0, spans[0][1]), (spans[-1][0], len(sizes))
    else:
        spans = list(_runs(sizes, stages))
    held = [sum(sizes[a:b]) for a, b in spans]
    held[-1] += copy if between_blocks else 0
    i = max(range(len(held)), key=held.__getitem__)
    return (*spans[i], held[i])


def stage_params(units: tuple[tuple[str, int], ...], stages: int) -> int:
    """Parameters of the fullest stage when ``units`` are cut into ``stages`` contiguous, balanced runs."""
    return fullest_stage(units, stages)[2]


def block_stage_params(units: tuple[tuple[str, int], ...], stages: int, copy: int = 0) -> int:
    """Parameters of the fullest stage when a pipeline cuts only between the blocks (``fullest_stage``)."""
    return fullest_stage(units, stages, between_blocks=True, copy=copy)[2]


def stage_flops(units: tuple[tuple[str, int], ...], unit_flops: tuple[float, ...], stages: int) -> float:
    """FLOPs of the busiest stage when ``units`` are cut as ``stage_params`` cuts them (balanced by parameters, as
    paratrain's pipeline cuts a model)."""
    sizes = tuple(s for _, s in units)
    return max(sum(unit_flops[a:b]) for a, b in _runs(sizes, stages))
