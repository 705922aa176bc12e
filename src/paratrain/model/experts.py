"""A model's mixture-of-experts layers: where the routed experts live and which experts each call is given.

Routed experts are found by what they are, whatever the module is named: a module (not a container) whose own 3-D
parameters share one first dimension ``E > 1`` (the expert: ``[experts, out, in]``, the dimension expert
parallelism splits) and whose ``forward`` takes the router's choice beside the rows, so at least two arguments
(a ``Conv1d``'s 3-D weight is called with one). transformers' MoE models (Mixtral, Qwen2/3-MoE, OLMoE, GPT-OSS …)
name it ``experts``, torchtitan's models ``moe.experts``, any other name does as well.

The router's choice reaches that module as an argument, so a forward pre-hook sees it without changing the model
(:meth:`ExpertLayer.routing`), in one of two conventions told apart by what the call carries, not by argument names:

- each token's k experts: ``(hidden_states [tokens, h], index [tokens, k] integers, weights [tokens, k])``
  (transformers);
- counts per expert: ``(rows sorted by expert, counts)``, the counts a 1-D tensor of ``E`` entries of any numeric
  dtype (torchtitan's ``GroupedExperts``, given ``torch.histc``'s counts, floats where its input is; paratrain's
  GPT; on the device, never read here) or a list of ``E`` numbers summing to the rows.

Experts kept as a ``ModuleList`` of separate MLPs (older transformers classes) are not found.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

WRAPPER_PARTS = frozenset({"module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})
"""Name parts wrappers add (DDP, ``torch.compile``, checkpointing, FSDP1): the same layer is named alike on every
rank and under every strategy without them."""

TAKES_HOST_COUNTS = "takes_host_counts"
"""A class attribute an experts module may set True: its forward takes the counts per expert as a host list as well
as the tensor its model gives (paratrain's GPT), so expert parallelism hands it the list it has already read and
spares the module a second host read of its own."""


@dataclass(frozen=True)
class Routing:
    """What one call of a routed-experts module carries: the router's choice, in the caller's own types."""

    rows: torch.Tensor
    """The first argument: the token rows sorted by expert (counts), or each token's hidden state (top k)."""
    chosen: torch.Tensor | list[int]
    """Rows per expert (a 1-D tensor of any numeric dtype, or a list), or each token's k experts ([tokens, k])."""
    weights: torch.Tensor | None = None
    """Each (token, k) slot's routing weight; None for counts."""

    @property
    def top_k(self) -> bool:
        """Whether the call carries each token's experts (and weights), not a count per expert."""
        return self.weights is not None


def routing(values: Sequence[Any], experts: int) -> Routing | None:
    """The router's choice in a call's arguments (``values``, in the forward's order) to a module of ``experts``
    experts: ``(rows, counts)`` or ``(hidden_states, index, weights)``; None when they are neither. Nothing is read
    from the device: a tensor's counts are checked by shape and dtype, a list's by its sum."""
    if len(values) < 2 or not _floating(values[0]) or values[0].dim() != 2:
        return None
    rows, chosen = values[0], values[1]
    if isinstance(chosen, torch.Tensor) and chosen.dim() == 2 and not chosen.is_floating_point():
        weights = values[2] if len(values) > 2 else None
        fits = chosen.shape[0] == rows.shape[0] and _floating(weights) and weights.shape == chosen.shape
        return Routing(rows, chosen, weights) if fits and chosen.dtype != torch.bool else None
    if isinstance(chosen, torch.Tensor):
        numeric = not chosen.is_complex() and chosen.dtype != torch.bool
        return Routing(rows, chosen) if numeric and chosen.dim() == 1 and chosen.numel() == experts else None
    if isinstance(chosen, (list, tuple)) and len(chosen) == experts:
        numbers = all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in chosen)
        if numbers and sum(chosen) == rows.shape[0]:
            return Routing(rows, list(chosen))
    return None


def _floating(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


@dataclass(frozen=True)
class ExpertLayer:
    """One MoE layer's routed experts."""

    name: str
    """The experts module's qualified name, wrappers' parts left out (``model.layers.3.mlp.experts``)."""
    module: nn.Module
    experts: int
    """How many routed experts it holds (its ``num_experts``, else the first dimension of its 3-D parameters)."""
    signature: inspect.Signature
    """Its forward's, taken when it was found: a call's arguments are read in that order."""

    @property
    def label(self) -> str:
        """A short name for figures: ``layer3`` from the last number in the name (the block's index), else the
        layer's name."""
        numbers = [p for p in self.name.split(".") if p.isdigit()]
        return f"layer{numbers[-1]}" if numbers else self.name

    def routing(self, args: Sequence[Any], kwargs: dict[str, Any]) -> Routing | None:
        """What one call of the module (``args``, ``kwargs``, as a forward pre-hook sees them) routes."""
        return routing(call_values(self.signature, args, kwargs), self.experts)


def call_values(signature: inspect.Signature, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
    """A call's arguments in ``signature``'s order, whatever the caller named them or passed by keyword (as given
    where they do not bind)."""
    try:
        return list(signature.bind(*args, **kwargs).arguments.values())
    except TypeError:
        return [*args, *kwargs.values()]


def _experts_of(module: nn.Module) -> int:
    """The experts ``module`` holds: the first dimension its own 3-D parameters share (its ``num_experts`` where it
    says); 0 when it has none, they differ, or its forward cannot take the router's choice beside the rows."""
    firsts = {p.shape[0] for p in module.parameters(recurse=False) if p.dim() == 3}
    if len(firsts) != 1 or isinstance(module, (nn.ModuleList, nn.ModuleDict)) or not _takes_two(module):
        return 0
    count = getattr(module, "num_experts", None)
    return count if isinstance(count, int) and count > 0 else firsts.pop()


def _takes_two(module: nn.Module) -> bool:
    """Whether ``module``'s forward takes two arguments or more."""
    kinds = [p.kind for p in inspect.signature(module.forward).parameters.values()]
    return inspect.Parameter.VAR_POSITIONAL in kinds or sum(k != inspect.Parameter.VAR_KEYWORD for k in kinds) >= 2


def find_expert_layers(model: nn.Module) -> list[ExpertLayer]:
    """Every module of ``model`` holding routed experts (the module docstring's test), in the model's order."""
    found = []
    for name, module in model.named_modules():
        experts = _experts_of(module)
        if experts > 1:
            parts = [p for p in name.split(".") if p not in WRAPPER_PARTS]
            found.append(ExpertLayer(".".join(parts), module, experts, inspect.signature(module.forward)))
    return found


def has_experts(model: nn.Module) -> bool:
    """Whether ``model`` has a mixture-of-experts layer :func:`find_expert_layers` finds."""
    return bool(find_expert_layers(model))


def dispatched_bytes(routed: Routing | None) -> int:
    """Bytes of token activations one call sends to its experts: each token once per expert it goes to (what expert
    parallelism's all-to-all moves each way). 0 when the call carries no :class:`Routing`."""
    if routed is None:
        return 0
    width = routed.rows.shape[-1] * routed.rows.element_size()
    if not routed.top_k:
        return routed.rows.shape[0] * width  # the rows already hold a copy per slot
    assert isinstance(routed.chosen, torch.Tensor)
    return routed.chosen.numel() * width
