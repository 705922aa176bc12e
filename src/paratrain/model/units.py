"""Which sub-modules become sharding units (one ``fully_shard`` call each) — FSDP's wrap policy.

The default unit is the repeated block (see :mod:`paratrain.model.structure`): one all-gather and one
reduce-scatter per block is what every fast FSDP setup uses; a unit per large ``nn.Linear`` cost 1.8–2.2x the
step time of a 124M GPT on an H100. Outside the blocks (the embedding, the output head) and in models without
blocks, a module becomes a unit when it holds at least ``min_params`` parameters no smaller unit took, so a
large head is not gathered for the whole forward as part of the root.

Two rules keep every model shardable:

* modules that share a parameter (a tied embedding and output head) are sharded together, as one group
  (``fully_shard([wte, lm_head])``), and no unit may hold only one of them: sharding them apart fails on torch
  2.13 and silently unties them on 2.11;
* a container without a forward (``ModuleList``/``ModuleDict``, which PEFT models put in reach) is never a
  unit: ``fully_shard`` refuses it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch import nn

from .structure import find_blocks
from .ties import find_ties

if TYPE_CHECKING:
    from .facts import ModelFacts

_NO_FORWARD = (nn.ModuleList, nn.ModuleDict)


def shard_units(
    model: nn.Module,
    *,
    wrap_classes: Sequence[type[nn.Module]] = (),
    min_params: int = 100_000,
    facts: ModelFacts | None = None,
) -> list[list[nn.Module]]:
    """The units of ``model`` (never the root), innermost first; each is one module or a tied group.

    ``wrap_classes``: the user's unit classes instead of the found blocks. ``facts``: ``model``'s, found by
    ``prepare`` (else its blocks and ties are found here).
    """
    if wrap_classes:
        fixed = {id(m) for m in model.modules() if isinstance(m, tuple(wrap_classes)) and m is not model}
    else:
        blocks = facts.blocks if facts is not None else find_blocks(model)
        fixed = {id(m) for m in blocks.modules(model)} if blocks else set()
    ties = facts.ties if facts is not None else find_ties(model)
    tie_groups = [
        list({id(m): m for m in (model.get_submodule(o) for o in owners)}.values()) for owners in ties.owners()
    ]
    tied = {id(m) for group in tie_groups for m in group}
    fixed -= tied  # a tied module is sharded with its partners, never alone
    units: list[list[nn.Module]] = []
    taken: set[int] = set()

    def visit(module: nn.Module) -> bool:
        """Choose units under ``module``; True when ``module`` holds a tied owner (so it cannot be a unit)."""
        if id(module) in fixed:
            units.append([module])
            taken.update(id(p) for p in module.parameters())
            return False
        holds_tie = False
        for child in module.children():
            holds_tie |= visit(child)
        if id(module) in tied:
            taken.update(id(p) for p in module.parameters())
            return True
        if holds_tie or module is model or isinstance(module, _NO_FORWARD):
            return holds_tie
        if sum(p.numel() for p in module.parameters() if id(p) not in taken) >= min_params:
            units.append([module])
            taken.update(id(p) for p in module.parameters())
        return False

    visit(model)
    return units + tie_groups
