"""``ParallelDims``: the one definition of a layout — how many ranks replicate, shard, pipeline and split each layer.

The runtime mesh (:func:`paratrain.distributed.mesh.build_mesh`), every strategy (``Strategy.dims``) and the
planner's candidate layouts (:class:`paratrain.planner.layout.Layout`) all read their degrees from here, so a
layout the planner describes is the one the runtime builds. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """The parallel degrees of a job; their product over the mesh dimensions is the number of ranks."""

    dp_replicate: int = 1
    """Replicas that each hold the whole (unsharded) state and all-reduce gradients: DDP's ranks, HSDP's groups."""
    dp_shard: int = 1
    """Ranks one shard group spans (ZeRO/FSDP); 1 without sharding."""
    zero: int = 0
    """What the shard group shards (ZeRO stage): 0 nothing, 1 optimizer states, 2 and gradients, 3 and parameters."""
    pp: int = 1
    """Pipeline stages, one rank each, computing different micro-batches at once."""
    tp: int = 1
    """Tensor-parallel ranks: consecutive ranks that split every layer's matrices."""
    mp: int = 1
    """Model-parallel stages inside one process (its GPUs take turns): not a mesh dimension."""
    ep: int = 1
    """Expert-parallel ranks: each of a group of ``ep`` data-parallel ranks holds 1/ep of every mixture-of-experts
    layer's experts, and tokens travel to their expert's rank and back (all-to-all). The group is carved out of the
    data-parallel ranks that hold one copy of the model (``dp_shard`` under ZeRO, ``dp_replicate`` without), so it
    adds no ranks; under ZeRO the experts are sharded over the ``dp_shard / ep`` ranks left. Beside ``cp`` the group
    is carved out of the ``dp x cp`` ranks (each routes its own slice of the sequences); beside ``tp`` each tp rank
    has its own groups, the experts whole to tensor parallelism (not beside both)."""
    cp: int = 1
    """Context-parallel ranks: each of a group of ``cp`` ranks holds 1/cp of every sequence of the same samples, and
    attention sees the whole sequence through an all-to-all (Ulysses). They read the same samples, so they are no
    data-parallel replicas, but their gradients are reduced together with the data-parallel ranks' (``dp x cp``)."""

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "pp", "tp", "mp", "ep", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"parallel degree {name}={value!r} must be an integer >= 1")
        if self.zero not in (0, 1, 2, 3):
            raise ConfigError(f"zero stage must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.zero == 0 and self.dp_shard > 1:
            raise ConfigError(
                f"dp_shard={self.dp_shard} shards nothing at zero stage 0; give a zero stage or "
                "replicate instead (dp_replicate)"
            )
        if self.mp > 1 and (self.tp > 1 or self.pp > 1):
            raise ConfigError(
                "model-parallel stages inside a process do not compose with pipeline or tensor "
                "parallelism; use pipeline stages (pp) instead"
            )
        if self.ep > 1:
            self._check_ep()
        if self.cp > 1 and self.mp > 1:
            raise ConfigError(
                "context parallelism splits sequences over ranks; model-parallel stages inside a "
                "process do not compose with it: use pipeline stages (pp) instead"
            )

    def _check_ep(self) -> None:
        """``ep`` must divide the ranks that hold one copy: the experts are split over them, not over the replicas
        of a copy (hsdp's nodes) or a process's own GPUs."""
        group, name = (self.dp_shard, "dp_shard") if self.zero else (self.dp_replicate, "dp_replicate")
        if self.cp > 1 and self.tp > 1:
            raise ConfigError(
                f"ep beside both cp={self.cp} and tp={self.tp} is not supported yet; drop one of cp and "
                "tp (ep composes with each alone)"
            )
        if self.cp > 1:  # a cp group's ranks hold one copy too, each routing its slice of the sequences
            group, name = group * self.cp, f"{name} x cp"
        if self.mp > 1:
            raise ConfigError(
                "expert parallelism splits experts over ranks; model-parallel stages inside a process "
                "do not compose with it: use pipeline stages (pp) instead"
            )
        if group % self.ep:
            raise ConfigError(
                f"ep={self.ep} must divide the {group} data-parallel ranks that hold one copy of the "
                f"model ({name}); give an ep that divides {group}"
            )

    @property
    def dp(self) -> int:
        """Data-parallel replicas: ranks that read different samples."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        """Ranks (processes) the layout needs; ``mp``'s devices belong to one process."""
        return self.dp * self.pp * self.cp * self.tp

    def mesh_shape(self) -> dict[str, int]:
        """Mesh dimension names → sizes, outermost first, as the strategies address them.

        The data-parallel dimension is always there: ``dp`` (size 1 when nothing replicates or shards), or
        ``replicate`` × ``shard`` when both are above 1 (HSDP). ``pp``, ``cp`` and ``tp`` follow when above 1,
        ``tp`` innermost and ``cp`` next to it, so that the ranks of a tensor- or context-parallel group, which talk
        in every layer, are neighbours (on a node, NVLink peers).
        ``ep`` is no dimension here: its groups are made of data-parallel ranks.
        """
        shape = (
            {"replicate": self.dp_replicate, "shard": self.dp_shard}
            if self.dp_replicate > 1 and self.dp_shard > 1
            else {"dp": self.dp}
        )
        if self.pp > 1:
            shape["pp"] = self.pp
        if self.cp > 1:
            shape["cp"] = self.cp
        if self.tp > 1:
            shape["tp"] = self.tp
        return shape

    def validate(self, world_size: int) -> None:
        """A ``ConfigError`` naming the degrees unless they multiply to ``world_size``."""
        if self.world_size != world_size:
            shape = " x ".join(f"{k}={v}" for k, v in self.mesh_shape().items())
            raise ConfigError(
                f"mesh {shape} needs {self.world_size} processes but the world size is {world_size}; "
                "change the degrees or the number of processes"
            )

    def describe(self) -> str:
        """``dp=4 (zero3) pp=2 tp=2``: the degrees above 1, for messages and plans."""
        parts = [f"{k}={v}" for k, v in self.mesh_shape().items() if v > 1]
        if self.zero:
            parts.append(f"zero{self.zero}")
        if self.mp > 1:
            parts.append(f"mp={self.mp}")
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        return " ".join(parts) or "1 rank"
