"""Proving, on a model's first batch, that its loss is the cross-entropy computed at its head in chunks.

A model that computes its own loss (transformers' ``labels=``, nanoGPT's ``model(x, y)``) or a ``loss_fn`` is code
paratrain cannot read, and may differ from a plain token cross-entropy in ways no name tells: label smoothing, a
z-loss, scaled or soft-capped logits, an auxiliary loss. So the first batch is cut to one sample of at most
``WINDOW`` positions (its first and last ones, where padding and prompts sit) and run twice: as the model runs
it, finding the head on the way (:func:`.head.find_head`), and with the loss computed at the head by each candidate
:class:`~.recipes.Recipe`. The first candidate whose loss equals the model's is kept for every later batch; none
equal is a one-line error. Both runs draw the same random numbers (dropout) and leave the generators as they were.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..batch import LOSS_KEYWORDS, ModelCall
from ..errors import ConfigError
from .head import Compute, Head, armed, find_head
from .recipes import Recipe, candidates, target_key

WINDOW = 64
"""Positions of the first batch's first sample the proof runs on."""


@dataclass(frozen=True)
class Proven:
    """A model's head and the recipe its loss was proven to follow."""

    head: Head
    recipe: Recipe
    keep_last: bool
    """The model takes transformers' ``logits_to_keep``: with it, the head's own call costs one position."""

    def loss(self, model: nn.Module, root: nn.Module, call: ModelCall, precision: Any, chunk: int) -> torch.Tensor:
        """The loss of ``call``, computed at the head of the prepared ``model`` (whose user module is ``root``)."""
        return run_at_head(
            model,
            root,
            self.head,
            self.call_without_targets(call),
            precision,
            lambda hidden, layer: self.recipe.loss(hidden, layer, call, chunk),
        )

    def call_without_targets(self, call: ModelCall) -> ModelCall:
        """``call`` without what only its loss reads, so the model computes no loss on full logits itself."""
        kwargs = {k: v for k, v in call.kwargs.items() if k not in LOSS_KEYWORDS}
        if self.keep_last:
            kwargs.setdefault("logits_to_keep", 1)
        return ModelCall(x=call.x, kwargs=kwargs)


def run_at_head(
    model: nn.Module, root: nn.Module, head: Head, call: ModelCall, precision: Any, compute: Compute
) -> torch.Tensor:
    """``compute``'s result at ``head`` in a forward of ``model`` on ``call``."""
    with armed(root, head, compute) as state, precision.compute_dtype_outputs():
        out = call.forward(model)
    return state.taken(out)


def prove(
    model: nn.Module, root: nn.Module, call: ModelCall, precision: Any, device: torch.device, chunk: int
) -> Proven:
    """The head of ``root`` (the user's module inside the prepared ``model``) and the recipe of ``call``'s loss,
    proven on a window of ``call`` (see the module docstring); a one-line error when there is none."""
    name = type(root).__name__
    key = target_key(call)
    if key is None:
        raise ConfigError(
            f"loss_chunk: forward_backward got no targets for {name} (labels=, model(x, y) or a "
            "loss_fn's target); pass them, or drop loss_chunk"
        )
    probe = window(call, key)
    with _aside(device):
        found, plain = find_head(root, lambda: precision.loss(model, probe, device))
    if isinstance(found, str):
        raise ConfigError(f"loss_chunk: {name} cannot have its loss computed at its head: {found}; drop loss_chunk")
    if not torch.isfinite(plain):
        raise ConfigError(
            f"loss_chunk: the loss of {name} on a slice of the first batch is {float(plain)}, nothing to "
            "prove the chunked loss against; start with a batch whose first sample has targets"
        )
    recipes = candidates(probe, root)
    keep_last = "logits_to_keep" in inspect.signature(root.forward).parameters
    first = Proven(found, recipes[0], keep_last)
    with _aside(device):
        ours = run_at_head(
            model,
            root,
            found,
            first.call_without_targets(probe),
            precision,
            lambda hidden, layer: torch.stack([_tried(r, hidden, layer, probe, chunk) for r in recipes]),
        )
    exact = getattr(precision, "autocast_dtype", None) is None and found.layer.weight.dtype == torch.float32
    for recipe, value in zip(recipes, ours):
        if torch.isclose(value, plain.float(), rtol=1e-5 if exact else 2e-2, atol=0.0):
            return Proven(found, recipe, keep_last)
    raise ConfigError(
        f"loss_chunk: the loss of {name} on a slice of the first batch is {float(plain):.6g}, the "
        f"cross-entropy of its head's logits {float(ours[0]):.6g}: it is not a plain token cross-entropy "
        "(label smoothing, a z-loss, scaled logits, an auxiliary loss?); drop loss_chunk"
    )


def _tried(recipe: Recipe, hidden: torch.Tensor, layer: nn.Linear, call: ModelCall, chunk: int) -> torch.Tensor:
    """The recipe's loss, NaN where it does not apply (targets shaped unlike the head's rows)."""
    try:
        return recipe.loss(hidden, layer, call, chunk).float()
    except (ConfigError, RuntimeError, IndexError):
        return torch.tensor(float("nan"), device=hidden.device)


def window(call: ModelCall, key: str) -> ModelCall:
    """``call`` cut to its first sample and, along the targets' positions, to the first and last ``WINDOW // 2``:
    every input's dimension as long as the batch (the first) or the sequence (the others) is cut alike."""
    targets = call.target if key == "target" else call.loss_kwargs[key]
    batch = targets.shape[0] if targets.dim() else None
    length = targets.shape[-1] if targets.dim() >= 2 else None
    keep = None
    if length is not None and length > WINDOW:
        keep = torch.cat([torch.arange(WINDOW // 2), torch.arange(length - WINDOW // 2, length)])

    def cut(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        for dim in range(value.dim()):
            if dim == 0 and value.shape[0] == batch:
                value = value[:1]
            elif keep is not None and value.shape[dim] == length:
                value = value.index_select(dim, keep.to(value.device))
        return value

    return ModelCall(
        x=tree_map(cut, call.x),
        kwargs=tree_map(cut, dict(call.kwargs)),
        target=tree_map(cut, call.target),
        loss_kwargs=tree_map(cut, dict(call.loss_kwargs)),
        loss_fn=call.loss_fn,
    )


@contextmanager
def _aside(device: torch.device) -> Iterator[None]:
    """No gradients, and the random generators put back after (both runs draw the same dropout)."""
    cuda = device.type == "cuda"
    with torch.no_grad(), torch.random.fork_rng(devices=[device] if cuda else [], device_type=device.type):
        yield
