"""Which cross-entropy a training call computes: where its targets are, how they line up with the logits, and what
the summed loss is divided by.

Three kinds of call reach ``forward_backward`` with a token loss: transformers' ``labels=`` (the label of position
``t + 1`` is position ``t``'s target; ``shift_labels=`` comes pre-shifted), nanoGPT's ``model(x, y)`` (aligned), and
a ``loss_fn`` over the logits (aligned, or shifted inside the function). Each recipe here is a candidate; which one a
model's loss is, is proven by running both (:mod:`.proof`), never assumed from the model's name.

Targets below zero are ignored, whatever the model's ``ignore_index`` (transformers' -100, nanoGPT's -1): the plain
loss fails on any other negative target, so the two agree wherever the plain loss is defined.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ..batch import ModelCall, counted
from ..errors import ConfigError
from .chunked import chunked_cross_entropy

IGNORED = -100


@dataclass(frozen=True)
class Recipe:
    """How a call's targets line up with the logits, and the soft-capping applied to them."""

    key: str
    """Where the targets are: a keyword of the model's own loss (``labels``), or ``target`` (positional, or a
    ``loss_fn``'s)."""
    shift: bool
    """Position ``t``'s target is ``targets[..., t + 1]`` (the last position has none)."""
    softcap: float | None = None
    """Logits pass through ``softcap * tanh(logits / softcap)`` first (Gemma's ``final_logit_softcapping``)."""

    def targets(self, call: ModelCall) -> torch.Tensor:
        """The call's targets, one per logit row, negatives turned into the ignored value."""
        found = call.target if self.key == "target" else call.loss_kwargs[self.key]
        if self.shift:
            found = F.pad(found, (0, 1), value=IGNORED)[..., 1:]
        return found.masked_fill(found < 0, IGNORED)

    def loss(self, hidden: torch.Tensor, head: nn.Linear, call: ModelCall, chunk: int) -> torch.Tensor:
        """The loss of ``call``, from the hidden states the head reads: summed over the targets, divided by their
        count, or by ``num_items_in_batch`` where the call passes it (transformers' rule for accumulation), or by
        the replica's share of a packed global batch's count (:attr:`ModelCall.items`)."""
        targets = self.targets(call).to(hidden.device)
        if hidden.shape[:-1] != targets.shape:
            raise ConfigError(
                f"loss_chunk: the head reads hidden states of shape {tuple(hidden.shape)} but the "
                f"targets have shape {tuple(targets.shape)}; drop loss_chunk for this model"
            )
        total = chunked_cross_entropy(
            hidden, head, targets, chunk=chunk, ignore_index=IGNORED, reduction="sum", softcap=self.softcap
        )
        items = call.loss_kwargs.get("num_items_in_batch")
        items = call.items if items is None else items
        return total / (items if items is not None else (targets != IGNORED).sum())


def target_key(call: ModelCall) -> str | None:
    """Where ``call``'s targets are (see :attr:`Recipe.key`), or None when it has none."""
    if call.target is not None:
        return "target"
    return next((k for k in ("shift_labels", "labels", "targets") if call.loss_kwargs.get(k) is not None), None)


def counted_targets(call: ModelCall) -> torch.Tensor | None:
    """How many targets the model's own ``labels=``/``shift_labels=`` loss averages over (``labels`` are shifted
    first, as transformers' causal-LM loss does), or None where the call has a ``loss_fn`` or no such targets."""
    key = target_key(call)
    if call.loss_fn is not None or key not in ("labels", "shift_labels"):
        return None
    found = call.loss_kwargs[key]
    return counted(found[..., 1:] if key == "labels" else found)


def candidates(call: ModelCall, model: nn.Module) -> list[Recipe]:
    """The recipes ``call``'s loss may be, most likely first (the first one proven is kept)."""
    key = target_key(call)
    if key is None:
        return []
    softcap = _softcap(model)
    aligned, shifted = Recipe(key, shift=False, softcap=softcap), Recipe(key, shift=True, softcap=softcap)
    many = _targets(call, key).dim() >= 2  # per position: a sequence a shift applies to
    if key == "labels" and many:
        return [shifted, aligned]  # transformers' causal LMs; its masked LMs align
    return [aligned, shifted] if many and not call.own_loss else [aligned]


def _targets(call: ModelCall, key: str) -> Any:
    return call.target if key == "target" else call.loss_kwargs[key]


def _softcap(model: nn.Module) -> float | None:
    cap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    return float(cap) if isinstance(cap, (int, float)) and cap > 0 else None
