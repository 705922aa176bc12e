"""A model's mixture-of-experts layers: where the routed experts live and which experts each call is given.

transformers' MoE models (Mixtral, Qwen2/3-MoE, OLMoE, GPT-OSS …) and paratrain's GPT keep the routed experts of a
block in a module named ``experts`` holding 3-D parameters ``[experts, …]`` (the dimension expert parallelism
splits). The router's choice reaches that module as an argument, so a forward pre-hook sees it without changing
the model: transformers passes ``(hidden_states, top_k_index, top_k_weights)``, the expert of each token's k slots;
paratrain's GPT passes ``(rows, counts)``, the token copies sorted by expert and how many each expert gets.
Experts kept as a ``ModuleList`` of separate MLPs (older transformers classes) are not found.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

WRAPPER_PARTS = frozenset({"module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})
"""Name parts wrappers add (DDP, ``torch.compile``, checkpointing, FSDP1): the same layer is named alike on every
rank and under every strategy without them."""


@dataclass(frozen=True)
class ExpertLayer:
    """One MoE layer's routed experts."""

    name: str
    """The ``experts`` module's qualified name, wrappers' parts left out (``model.layers.3.mlp.experts``)."""
    module: nn.Module
    experts: int
    """How many routed experts it holds (on this rank: the first dimension of its 3-D parameters)."""

    @property
    def label(self) -> str:
        """A short name for figures: ``layer3`` from the last number in the name (the block's index), else the
        layer's name."""
        numbers = [p for p in self.name.split(".") if p.isdigit()]
        return f"layer{numbers[-1]}" if numbers else self.name


def _experts_of(module: nn.Module) -> int:
    """The experts a module named ``experts`` holds: its ``num_experts``, else the first dimension its 3-D
    parameters share; 0 when it is not such a module."""
    count = getattr(module, "num_experts", None)
    if isinstance(count, int) and count > 0:
        return count
    firsts = {p.shape[0] for p in module.parameters(recurse=False) if p.dim() == 3}
    return firsts.pop() if len(firsts) == 1 else 0


def find_expert_layers(model: nn.Module) -> list[ExpertLayer]:
    """Every module named ``experts`` holding routed experts as 3-D parameters, in the model's order."""
    found = []
    for name, module in model.named_modules():
        parts = [p for p in name.split(".") if p not in WRAPPER_PARTS]
        if parts and parts[-1] == "experts" and not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            experts = _experts_of(module)
            if experts > 1:
                found.append(ExpertLayer(".".join(parts), module, experts))
    return found


def has_experts(model: nn.Module) -> bool:
    """Whether ``model`` has a mixture-of-experts layer :func:`find_expert_layers` finds."""
    return bool(find_expert_layers(model))


def routed_choice(args: Sequence[Any], kwargs: dict[str, Any]) -> torch.Tensor | list[int] | None:
    """What one call of an ``experts`` module routes: transformers' ``top_k_index`` (an integer tensor, tokens x k,
    each slot's expert) or paratrain's GPT's ``counts`` (tokens per expert: a 1-D integer tensor on the device, or a
    list); None when the call carries neither. :func:`is_top_k` tells the two apart."""
    chosen = (
        args[1]
        if len(args) > 1
        else next((kwargs[k] for k in ("top_k_index", "router_indices", "selected_experts") if k in kwargs), None)
    )
    if isinstance(chosen, torch.Tensor) and not chosen.is_floating_point() and not chosen.is_complex():
        return chosen
    if isinstance(chosen, (list, tuple)) and all(isinstance(c, int) for c in chosen):
        return list(chosen)
    return None


def is_top_k(chosen: torch.Tensor | list[int]) -> bool:
    """Whether a :func:`routed_choice` is each slot's expert (tokens x k), not a count per expert."""
    return isinstance(chosen, torch.Tensor) and chosen.dim() > 1


def dispatched_bytes(args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    """Bytes of token activations one call sends to its experts: each token once per expert it goes to (what expert
    parallelism's all-to-all moves each way). 0 when the call is not one :func:`routed_choice` reads."""
    chosen = routed_choice(args, kwargs)
    hidden = args[0] if args else kwargs.get("hidden_states")
    if chosen is None or not isinstance(hidden, torch.Tensor):
        return 0
    width = hidden.shape[-1] * hidden.element_size()
    if not is_top_k(chosen):
        return hidden.shape[0] * width  # the rows already hold a copy per slot
    return chosen.numel() * width
