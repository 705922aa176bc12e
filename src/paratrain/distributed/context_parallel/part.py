"""The part of a strategy that splits sequences over ranks (``cp=``), and its absence.

Every composable strategy holds one (``Strategy.cp``) and calls its hooks unconditionally, as it does its
tensor-parallel part: :class:`WholeSequences` gives every answer back unchanged; :class:`ContextParallel` splits.
The cp ranks of a job read the same samples (they are one data-parallel replica: the loader, ``par.mean`` and the
random streams use the ``dp`` coordinate) but hold different tokens, so their gradients are reduced together with
the data-parallel ranks': DDP or FSDP2 run over ``dp x cp`` flattened (torchtitan's ``dp_shard_cp``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ...errors import ConfigError

if TYPE_CHECKING:
    from ...batch import ModelCall
    from ...options import CPConfig
    from .sequence import SequenceSplit

Step = Callable[[nn.Module], nn.Module]
DataParallel = tuple[int, int, "dist.ProcessGroup | None"]
_DATA_DIMS = ("dp", "replicate", "shard")


class WholeSequences:
    """No context parallelism: every rank sees whole sequences."""

    splits = False
    """Each rank holds a slice of every sequence."""

    def degree(self, strategy: str, ranks: int) -> int:
        """Ranks that split each sequence, out of the ``ranks`` left beside tensor parallelism."""
        return 1

    def step(self, mesh: DeviceMesh | None) -> Step | None:
        """:func:`~paratrain.distributed.parallelize.parallelize`'s ``cp``: the step that splits sequences over
        ``mesh["cp"]``; None: nothing to split."""
        return None

    def gradient_mesh(self, mesh: DeviceMesh | None, data: DeviceMesh | None) -> DeviceMesh | None:
        """The mesh the data-parallel engine reduces gradients over: ``data`` (the data-parallel part)."""
        return data

    def data_parallel(self, mesh: DeviceMesh | None, known: DataParallel) -> DataParallel:
        """(rank, size, group) of the replicas that read different data: ``known`` when sequences are whole."""
        return known

    def batch(self, call: ModelCall) -> ModelCall:
        """``forward_backward``'s micro-batch as this rank runs it."""
        return call

    def head_loss_refusal(self) -> str | None:
        """Why the split stops the loss from being computed at the head in chunks, or None."""
        return None

    def describe(self) -> str | None:
        return None


class ContextParallel(WholeSequences):
    """Sequences split over ``mesh["cp"]``, attention whole per head group (Ulysses) or per rank's rows (the
    all-gather of keys and values)."""

    splits = True

    def __init__(self, config: CPConfig) -> None:
        self.config = config
        self.split: SequenceSplit | None = None
        self.method: str | None = None
        """The method the prepared model runs (``config.method`` with ``auto`` resolved)."""
        self._flat: dict[str, DeviceMesh] = {}

    def degree(self, strategy: str, ranks: int) -> int:
        cp = self.config.degree
        if ranks % cp:
            raise ConfigError(
                f"{strategy} with cp={cp} needs a number of processes (beside tp) that cp divides, "
                f"got {ranks}; launch a multiple of cp x tp processes, or choose another cp"
            )
        return cp

    def step(self, mesh: DeviceMesh | None) -> Step:
        assert mesh is not None
        return lambda model: self.apply(model, mesh)

    def apply(self, model: nn.Module, mesh: DeviceMesh) -> nn.Module:
        """Hook ``model`` so that its calls are cut to this rank's slice and its attention sees whole sequences."""
        from .attention import choose_method, wrap_attention
        from .sequence import SequenceSplit

        if getattr(getattr(model, "config", None), "output_router_logits", False):
            raise ConfigError(
                f"cp cannot train {type(model).__name__} with its router's load-balancing loss "
                "(config.output_router_logits=True): each rank would add the loss of its slice of the "
                "sequences; set output_router_logits=False, or drop cp"
            )
        names = mesh.mesh_dim_names or ()
        heads_split = self.config.degree * (mesh["tp"].size() if "tp" in names else 1)
        self.method = choose_method(model, self.config.method, heads_split)
        self.split = SequenceSplit(model, mesh["cp"].get_group(), balanced=self.method == "allgather")
        wrap_attention(model, self.split, heads_split, self.method)
        self.split.check_positions(model)
        model.register_forward_pre_hook(self.split.before, with_kwargs=True)
        model.register_forward_hook(self.split.after, with_kwargs=True)
        return model

    def gradient_mesh(self, mesh: DeviceMesh | None, data: DeviceMesh | None) -> DeviceMesh | None:
        """``dp x cp`` flattened (``replicate x (shard x cp)`` under HSDP)."""
        assert mesh is not None
        inner = "shard" if "shard" in (mesh.mesh_dim_names or ()) else "dp"
        flat = self._flatten(mesh, (inner, "cp"))
        if inner == "dp":
            return flat
        concatenate = getattr(DeviceMesh, "_concatenate", None)  # torch 2.13; slicing a flattened dim from the root
        if concatenate is None:  # mesh warns of its deprecation there
            return mesh["replicate", "shard_cp"]
        return concatenate([mesh["replicate"], flat])

    def data_parallel(self, mesh: DeviceMesh | None, known: DataParallel) -> DataParallel:
        """The data-parallel coordinate, without the cp ranks (they read the same samples)."""
        if mesh is None:
            return known
        dims = tuple(n for n in _DATA_DIMS if n in (mesh.mesh_dim_names or ()))
        data = self._flatten(mesh, dims) if len(dims) > 1 else mesh[dims[0]]
        return data.get_local_rank(), data.size(), data.get_group() if data.size() > 1 else None

    def _flatten(self, mesh: DeviceMesh, dims: tuple[str, ...]) -> DeviceMesh:
        name = "_".join(dims)
        if name not in self._flat:
            self._flat[name] = mesh[dims]._flatten(name)
        return self._flat[name]

    def batch(self, call: ModelCall) -> ModelCall:
        """A ``loss_fn``'s target cut to this rank's slice, and its loss summed over the cp group by each rank's
        share of the counted tokens (the model's own loss is handled by the model's hooks)."""
        split, target = self.split, call.target
        if call.own_loss or target is None or split is None:
            return call
        if not hasattr(target, "dim") or target.dim() < 2:
            raise ConfigError(
                "cp splits loss_fn's target along the sequence (dimension 1) as it does the inputs; "
                "pass targets shaped [batch, seq, ...]"
            )
        loss_fn = call.loss_fn
        assert loss_fn is not None
        if call.items is not None:  # a packed batch's: each slice's sum over the replica's count, summed as it is
            return dataclasses.replace(
                call,
                target=split.local(target),
                loss_fn=lambda out, t: split.whole_loss(call.weigh(loss_fn(out, t), t), None),
                items=None,
            )
        share = split.counted_share(target)
        return dataclasses.replace(
            call, target=split.local(target), loss_fn=lambda out, t: split.whole_loss(loss_fn(out, t), share)
        )

    def head_loss_refusal(self) -> str:
        return "cp hands the head a slice of each sequence and sums the loss over the cp ranks itself"

    def describe(self) -> str:
        method = self.method or self.config.method
        return f"cp={self.config.degree}" + ("" if method in ("auto", "ulysses") else f", cp_method={method}")


def context_parallel(config: CPConfig | None) -> WholeSequences:
    """A strategy's context-parallel part for ``config`` (None: sequences whole)."""
    return WholeSequences() if config is None else ContextParallel(config)
