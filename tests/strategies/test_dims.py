"""``ParallelDims`` is the one definition of a layout: the mesh each strategy builds, and every candidate layout the
planner weighs is the layout the strategy of that name builds (worlds 1-8, with and without tensor parallelism)."""

from __future__ import annotations

import pytest

from paratrain import composition, strategies
from paratrain.dims import ParallelDims
from paratrain.env import ClusterEnv
from paratrain.errors import ConfigError
from paratrain.planner.hardware import make_cluster
from paratrain.planner.layout import Layout, layouts


@pytest.mark.parametrize(
    "dims, shape, world",
    [
        (ParallelDims(), {"dp": 1}, 1),
        (ParallelDims(dp_replicate=4), {"dp": 4}, 4),
        (ParallelDims(dp_shard=4, zero=3), {"dp": 4}, 4),
        (ParallelDims(dp_replicate=2, dp_shard=4, zero=3), {"replicate": 2, "shard": 4}, 8),
        (ParallelDims(pp=4), {"dp": 1, "pp": 4}, 4),
        (ParallelDims(dp_replicate=2, pp=2, tp=2), {"dp": 2, "pp": 2, "tp": 2}, 8),
        (ParallelDims(tp=8), {"dp": 1, "tp": 8}, 8),
        (ParallelDims(dp_replicate=2, mp=4), {"dp": 2}, 2),  # a process's GPUs are no mesh dimension
    ],
)
def test_mesh_shape_names_the_dimensions_the_strategies_address(dims, shape, world):
    assert dims.mesh_shape() == shape
    assert dims.world_size == world
    dims.validate(world)


def test_degrees_that_do_not_make_the_world_are_one_line():
    with pytest.raises(ConfigError, match=r"mesh dp=2 x tp=2 needs 4 processes but the world size is 8"):
        ParallelDims(dp_replicate=2, tp=2).validate(8)
    for bad, match in (
        ({"tp": 0}, "tp=0 must be an integer >= 1"),
        ({"zero": 4}, "zero stage must be"),
        ({"dp_shard": 2}, "shards nothing at zero stage 0"),
        ({"mp": 2, "tp": 2}, "do not compose"),
        ({"ep": 0}, "ep=0 must be an integer >= 1"),
        ({"dp_replicate": 4, "ep": 8}, r"ep=8 must divide the 4 data-parallel ranks .*\(dp_replicate\)"),
        ({"dp_replicate": 2, "dp_shard": 4, "zero": 3, "ep": 8}, r"divide the 4 .*\(dp_shard\)"),
        ({"dp_replicate": 2, "mp": 2, "ep": 2}, "model-parallel stages inside a process"),
    ):
        with pytest.raises(ConfigError, match=match):
            ParallelDims(**bad)


def test_expert_parallelism_is_carved_out_of_the_data_parallel_ranks():
    """``ep`` adds no ranks and no mesh dimension: its groups are data-parallel ranks holding one copy (a ZeRO shard
    group, or DDP's replicas), each holding 1/ep of the experts."""
    zero3 = ParallelDims(dp_shard=8, zero=3, ep=4)
    assert zero3.world_size == 8 and zero3.mesh_shape() == {"dp": 8} and zero3.describe() == "dp=8 zero3 ep=4"
    assert ParallelDims(dp_replicate=2, dp_shard=8, zero=3, ep=8, tp=2).world_size == 32  # hsdp: within a node
    assert ParallelDims(dp_replicate=8, ep=8).describe() == "dp=8 ep=8"


def _runtime(layout: Layout) -> tuple[str, dict]:
    """The strategy name and options that ask the runtime for ``layout``."""
    options: dict = {}
    if layout.tp > 1 and layout.name != "tp":
        options["tp"] = layout.tp
    for degree in ("cp", "ep"):
        if getattr(layout, degree) > 1:
            options[degree] = getattr(layout, degree)
    if layout.name == "hsdp":
        options["shard_size"] = layout.shard
    if layout.name == "hybrid":
        options["dp"] = layout.dp
        if layout.zero:
            options["data"] = {1: "zero1", 3: "fsdp"}[layout.zero]
    if layout.name == "model_parallel":
        options["stages"] = layout.mp
    if layout.servers:
        options["servers"] = layout.servers
    return layout.name, options


def _builds(layout: Layout) -> None:
    """Raise the runtime's own refusal unless the strategy builds exactly ``layout``."""
    name, options = _runtime(layout)
    ranks = layout.dims.world_size
    env = ClusterEnv(world_size=ranks, local_world_size=ranks, launched=ranks > 1)
    strategy = strategies.create(name, **options)
    strategy.validate(env)
    assert strategy.dims(env) == layout.dims, (layout, options)


def _candidates(world: int) -> list[Layout]:
    degrees = tuple(d for d in range(2, world + 1) if world % d == 0)
    one_node = layouts(
        make_cluster("h100", gpus=world, nodes=1), n_units=64, tp_degrees=degrees, ps_servers=max(1, world // 4)
    )
    two_nodes = layouts(make_cluster("h100", gpus=world // 2, nodes=2), n_units=64) if world % 2 == 0 else []
    return one_node + [layout for layout in two_nodes if layout.name == "hsdp"]


@pytest.mark.parametrize("world", range(1, 9))
def test_every_planned_layout_is_the_one_its_strategy_builds(world):
    seen = set()
    for layout in _candidates(world):
        _builds(layout)
        seen.add(layout.name)
    assert seen >= ({"single"} if world == 1 else {"ddp", "zero1", "zero2", "zero3", "ps"})
    if world >= 4 and world % 2 == 0:
        assert {"hsdp", "hybrid", "tp"} <= seen


def test_context_parallel_ranks_are_a_mesh_dimension_beside_tp():
    dims = ParallelDims(dp_shard=2, zero=3, cp=2, tp=2)
    assert dims.world_size == 8 and dims.dp == 2
    assert list(dims.mesh_shape().items()) == [("dp", 2), ("cp", 2), ("tp", 2)]
    assert "cp=2" in dims.describe()
    with pytest.raises(ConfigError, match="context parallelism"):
        ParallelDims(mp=2, cp=2)


@pytest.mark.parametrize("world", (4, 8))
def test_every_planned_ep_layout_is_the_one_its_strategy_builds(world):
    """ddp, zero2, zero3 and ``hybrid`` with ``ep=2`` as the planner lists them, and ddp, zero2, zero3 beside tp."""
    found = [
        lay
        for lay in layouts(make_cluster("h100", gpus=world), n_units=64, tp_degrees=(2,), ep_degrees=(2,))
        if lay.ep > 1
    ]
    assert "hybrid" in {lay.name for lay in found} and any(lay.tp == 2 for lay in found)
    for layout in found:
        _builds(layout)


@pytest.mark.parametrize("world", (2, 4, 8))
def test_every_planned_layout_with_cp_tp_and_ep_builds_and_no_refused_one_is_planned(world):
    """Every layout the planner can emit, cp included, is built by the runtime; each (strategy, degree) the table of
    :mod:`paratrain.composition` refuses is refused by the runtime and never planned (zero1 with cp was both)."""
    degrees = tuple(d for d in range(2, world + 1) if world % d == 0)
    pairs = tuple((t, c) for t in (1, *degrees) for c in degrees if world % (t * c) == 0)
    planned = layouts(
        make_cluster("h100", gpus=world), n_units=64, tp_degrees=degrees, ep_degrees=(2,), cp_pairs=pairs, ps_servers=1
    )
    assert {lay.name for lay in planned if lay.cp > 1} == {"ddp", "zero2", "zero3"}
    for layout in planned:
        _builds(layout)
    for name in composition.TAKES:
        for degree in ("tp", "cp", "ep"):
            if composition.refusal(name, **{degree: 2}) is None:
                continue
            assert not any(lay.name == name and getattr(lay, degree) > 1 for lay in planned), (name, degree)
            options = {degree: 2, **({"dp": 2} if name == "hybrid" else {})}
            with pytest.raises(ConfigError, match=rf"{degree}|experts|replica|takes no arguments"):
                strategies.registry.check_world(name, 8, **options)
