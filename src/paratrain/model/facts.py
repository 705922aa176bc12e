"""What a model is made of, found once per ``prepare`` and handed to every step that needs it: its repeated blocks,
its ties, and every parameter's names.

They are also what ``prepare`` must not lose: every parameter the user's optimizer trains, and every tie. A
wrapper that replaces parameters (FSDP's DTensors, a pipeline's stages) makes the optimizer be rebuilt over the new
objects; a parameter missed there, or a tie split into two tensors, trains silently wrong (the head never updates)
instead of failing. So the facts are taken before the model is wrapped and checked after, on every strategy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ConfigError
from .structure import Blocks, find_blocks
from .ties import Ties, find_ties


@dataclass(frozen=True)
class ModelFacts:
    """A model's blocks, ties and parameter names, taken before a strategy wraps it."""

    names: dict[int, tuple[str, ...]]
    """id(parameter) → every name it is reachable under, the first being what ``named_parameters`` says."""
    ties: Ties
    blocks: Blocks | None
    """The repeated blocks (:mod:`paratrain.model.structure`), or None for a model without them."""
    block_index: dict[int, int]
    """id(block module) → its index among the blocks: a pipeline stage finds the blocks it holds by identity."""

    @classmethod
    def of(cls, model: nn.Module) -> ModelFacts:
        names: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        blocks = find_blocks(model)
        index = {id(m): i for i, m in enumerate(blocks.modules(model))} if blocks is not None else {}
        return cls(
            names={k: tuple(v) for k, v in names.items()}, ties=find_ties(model), blocks=blocks, block_index=index
        )

    @property
    def first_names(self) -> dict[int, str]:
        """id(parameter) → its qualified name: how a rebuilt optimizer finds the parameters a wrapper replaced."""
        return {k: v[0] for k, v in self.names.items()}

    def check_ties(self, prepared: nn.Module, strategy: str) -> None:
        """Raise unless every tie of the original model is still one tensor in ``prepared`` (the unwrapped
        module; names a pipeline rank does not hold are skipped)."""
        broken = self.ties.broken(prepared)
        if broken:
            a, b = broken[0]
            raise ConfigError(
                f"strategy {strategy!r} split the tied parameters {a!r} and {b!r} into two tensors on "
                f"torch {torch.__version__}, so one of them would never train; use ddp or zero1 for "
                "this model, and report it"
            )

    def check_source(self, optimizer: torch.optim.Optimizer) -> None:
        """Raise unless every parameter ``optimizer`` holds belongs to the model passed to ``prepare``."""
        foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in self.names)
        if foreign:
            total = sum(len(g["params"]) for g in optimizer.param_groups)
            raise ConfigError(
                f"the optimizer holds {foreign} of {total} parameters that are not in the model passed "
                "to prepare(), so they would never train; build the optimizer from that model's "
                "parameters() and pass the model first"
            )

    def check_kept(
        self, original: torch.optim.Optimizer, prepared_opt: torch.optim.Optimizer, prepared: nn.Module, strategy: str
    ) -> None:
        """Raise unless every parameter ``original`` trained is trained by ``prepared_opt`` in ``prepared`` (the
        unwrapped module), under any of its names that this rank holds."""
        current = dict(prepared.named_parameters(remove_duplicate=False))
        held = {id(p) for g in prepared_opt.param_groups for p in g["params"]}
        for group in original.param_groups:
            for p in group["params"]:
                for name in self.names[id(p)]:
                    if name in current and id(current[name]) not in held:
                        partner = self.ties.partner(name)
                        tied = f" (tied to {partner!r})" if partner else ""
                        raise ConfigError(
                            f"after prepare() with strategy {strategy!r} the optimizer no longer trains "
                            f"{name!r}{tied}; use ddp or zero1 for this model, and report it"
                        )
