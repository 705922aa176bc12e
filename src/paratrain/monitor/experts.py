"""Tokens per expert, seen while training: how a mixture of experts routes the global batch, and when it collapses.

A forward pre-hook on each MoE layer's routed-experts module (:mod:`paratrain.model.experts`: any name) adds the
experts the router chose for this rank's tokens into a counter on the rank's device (no host sync, no collective).
At the monitor's window the counters of every layer go into one all-reduce over the training ranks, so every rank
holds the routing of the global batch; ranks that see the same tokens (a tensor-parallel group) are counted once.
A model without such layers gets no hook and no all-reduce.

Routing collapse, the failure mixtures of experts are known for, is a window where one expert gets
``expert_imbalance`` times its fair share or more (the busiest expert over the mean: DeepSeek's MaxVio + 1), or
where some experts get no token at all; the monitor's persistence turns it into one warning.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..model.expert_compute import count_per_expert
from ..model.experts import ExpertLayer, find_expert_layers
from .config import MonitorConfig
from .rules import Finding

LARGEST_SHOWN = 16
"""Up to this many experts a layer's table row shows every count; above, the least, median and most."""

FIX = (
    "raise the router's load-balancing (aux) loss coefficient (transformers: output_router_logits=True and "
    "router_aux_loss_coef), add a router z-loss, or lower the learning rate"
)


@dataclass(frozen=True)
class ExpertLoad:
    """One MoE layer's routing over a window: the tokens each expert was given, over every data-parallel rank."""

    layer: str
    """The routed-experts module's name."""
    label: str
    """Its short name in the trackers' figures (``layer3``)."""
    counts: tuple[int, ...]
    """Token slots routed to each expert (a token goes to each of its top k experts)."""

    @property
    def total(self) -> int:
        return sum(self.counts)

    @property
    def imbalance(self) -> float:
        """The busiest expert's tokens over the mean: 1.0 is perfectly balanced, ``experts / k`` the most there is."""
        return max(self.counts) * len(self.counts) / self.total if self.total else 0.0

    @property
    def busiest(self) -> int:
        return max(range(len(self.counts)), key=self.counts.__getitem__)

    @property
    def idle(self) -> tuple[int, ...]:
        """Experts that got no token (none when nothing was routed)."""
        return tuple(i for i, c in enumerate(self.counts) if c == 0) if self.total else ()

    def counts_text(self) -> str:
        if len(self.counts) <= LARGEST_SHOWN:
            return " ".join(str(c) for c in self.counts)
        ordered = sorted(self.counts)
        return f"least {ordered[0]}, median {ordered[len(ordered) // 2]}, most {ordered[-1]}"

    def to_dict(self) -> dict[str, Any]:
        return {"layer": self.layer, "counts": list(self.counts), "imbalance": self.imbalance, "idle": list(self.idle)}


def _in_backward() -> bool:
    """True while autograd runs a backward pass: activation checkpointing re-runs the forward there, and its
    routing must not be counted twice."""
    return torch._C._current_graph_task_id() != -1


def _pipelined(model: nn.Module) -> bool:
    from ..distributed.pipeline import PipelinedModel

    return isinstance(model, PipelinedModel)


class ExpertCounter:
    """One rank's tokens per expert since the last window, counted by hooks on the models' routed-experts modules."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.layers: list[ExpertLayer] = []
        self._counts: list[torch.Tensor] = []  # per layer: one slot an expert, on the device
        self._seen: set[int] = set()
        self._handles: list[Any] = []

    def watch(self, model: nn.Module) -> None:
        """Hook ``model``'s MoE layers the first time it is seen (a dense model: nothing). A pipeline stage holds
        only some layers, so the ranks' counters would not line up: pipelines are not counted."""
        if id(model) in self._seen:
            return
        self._seen.add(id(model))
        if _pipelined(model):
            return
        for layer in find_expert_layers(model):
            counts = torch.zeros(layer.experts, dtype=torch.int64, device=self.device)
            self.layers.append(layer)
            self._counts.append(counts)
            self._handles.append(layer.module.register_forward_pre_hook(self._hook(counts, layer), with_kwargs=True))

    @staticmethod
    def _hook(counts: torch.Tensor, layer: ExpertLayer) -> Any:
        def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if not torch.is_grad_enabled() or _in_backward():  # evaluation, or a checkpointed block's recompute
                return
            routed = layer.routing(args, kwargs)
            if routed is None:
                return
            if routed.top_k:
                counts.add_(count_per_expert(torch.as_tensor(routed.chosen).detach().to(counts.device), layer.experts))
            else:  # a count per expert of any dtype: on the device (nothing read), or a list the model already read
                counts.add_(torch.as_tensor(routed.chosen).detach().to(counts.device, torch.int64))

        return hook

    def window(self, group: dist.ProcessGroup | None, copies: int) -> list[ExpertLoad]:
        """Every layer's counts since the last call, summed over the ranks of ``group`` (one all-reduce), each token
        once (``copies``: ranks that see the same tokens); the counters start again from zero."""
        if not self.layers:
            return []
        flat = torch.cat(self._counts).to(torch.float64)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(flat, group=group)
        totals = (flat / max(copies, 1)).round().to(torch.int64).tolist()
        for counts in self._counts:
            counts.zero_()
        labels = [layer.label for layer in self.layers]
        loads, start = [], 0
        for layer, counts in zip(self.layers, self._counts):
            label = layer.label if labels.count(layer.label) == 1 else layer.name
            loads.append(ExpertLoad(layer.name, label, tuple(totals[start : start + layer.experts])))
            start += counts.numel()
        return loads

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def find_routing_collapse(loads: Sequence[ExpertLoad], config: MonitorConfig) -> list[Finding]:
    """One finding for the job when a layer's busiest expert gets ``expert_imbalance`` times the mean or more, or
    some of its experts get no token; it names the worst layer."""
    collapsed = [x for x in loads if x.total and (x.imbalance >= config.expert_imbalance or x.idle)]
    if not collapsed:
        return []
    worst = max(collapsed, key=lambda x: (x.imbalance, len(x.idle)))
    more = f" and {len(collapsed) - 1} more" if len(collapsed) > 1 else ""
    experts = len(worst.counts)
    idle = (
        f", {len(worst.idle)} of its {experts} experts got no token (expert{'s' if len(worst.idle) > 1 else ''} "
        f"{', '.join(map(str, worst.idle[:8]))}{' …' if len(worst.idle) > 8 else ''})"
        if worst.idle
        else ""
    )
    return [
        Finding(
            "routing",
            -1,
            worst.imbalance,
            (
                f"routing collapsed in MoE layer {worst.layer}{more}: expert {worst.busiest} gets "
                f"{max(worst.counts) / worst.total:.0%} of its routed tokens, {worst.imbalance:.1f}x the mean of its "
                f"{experts} experts ({config.expert_imbalance:g}x warns){idle}; {FIX}"
            ),
        )
    ]


def expert_figures(loads: Sequence[ExpertLoad]) -> dict[str, float]:
    """A window's routing as tracker scalars: ``moe/imbalance/<layer>`` and ``moe/idle_experts/<layer>``."""
    figures: dict[str, float] = {}
    for x in loads:
        if x.total:
            figures[f"moe/imbalance/{x.label}"] = x.imbalance
            figures[f"moe/idle_experts/{x.label}"] = float(len(x.idle))
    return figures
