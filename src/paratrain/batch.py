"""One micro-batch as ``Parallel.forward_backward`` hands it to the model, and where its loss comes from.

Two kinds of training code meet here. One computes the loss outside the model, ``loss_fn(model(x), y)``. The other
lets the model compute it, as transformers' causal LMs do with ``labels=`` and nanoGPT with ``model(x, y) ->
(logits, loss)``: then the loss is read from what the model returns (:func:`loss_of`). Strategies that run the
forward themselves need to know which inputs feed the model's first layer, which every part of it reads (an
attention mask) and which only its loss reads (the labels, used on a pipeline's last stage only); a
:class:`ModelCall` keeps them apart.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from .errors import ConfigError

LOSS_KEYWORDS = frozenset({"labels", "shift_labels", "targets", "target", "num_items_in_batch"})
"""Keyword inputs that only a model's own loss reads (transformers' ``labels``/``shift_labels``, nanoGPT-style
``targets``): a pipeline hands them to its last stage alone."""


@dataclass(frozen=True)
class ModelCall:
    """How one micro-batch is run: ``loss_fn(model(x, **kwargs), target)``, or with no ``loss_fn`` the model's own
    loss from ``model(x, target, **kwargs, **loss_kwargs)`` (``target`` left out when None)."""

    x: Any
    """The first positional input: token ids, images, or None when the batch came as keywords only."""
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Keyword inputs of the forward (an attention mask): every part of the model reads them."""
    target: Any = None
    """``loss_fn``'s target; without ``loss_fn``, the model's second positional input (nanoGPT's ``targets``)."""
    loss_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Keyword inputs only the model's own loss reads (``labels=``)."""
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    items: torch.Tensor | None = None
    """Set on a packed batch with a ``loss_fn`` (:meth:`ChosenStrategy.pack`): the global batch's counted targets a
    replica (their count over the replicas, divided by the replicas). The ``loss_fn``'s mean over its own counted
    targets is then made their sum over ``items`` (:meth:`weigh`), so a replica holding more real tokens weighs
    more, as in one process that averages over every document of the global batch."""

    @classmethod
    def of(cls, x: Any, target: Any, loss_fn: Callable | None, kwargs: Mapping[str, Any]) -> ModelCall:
        """From ``forward_backward``'s arguments: ``x`` a mapping is a batch of keyword inputs (a transformers
        batch: ``input_ids``, ``attention_mask``, ``labels``), and so is ``target`` without a ``loss_fn``."""
        if loss_fn is not None and not callable(loss_fn):
            raise ConfigError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        if isinstance(x, Mapping):
            kwargs = {**x, **kwargs}
            x = None
        own = {k: v for k, v in kwargs.items() if k in LOSS_KEYWORDS}
        rest = {k: v for k, v in kwargs.items() if k not in LOSS_KEYWORDS}
        if loss_fn is not None:
            return cls(x=x, kwargs={**rest, **own}, target=target, loss_fn=loss_fn)
        if isinstance(target, Mapping):  # forward_backward(model, x, {"labels": y})
            return cls(x=x, kwargs=rest, loss_kwargs={**target, **own})
        return cls(x=x, kwargs=rest, target=target, loss_kwargs=own)

    @property
    def own_loss(self) -> bool:
        """The model computes the loss itself."""
        return self.loss_fn is None

    def args(self) -> tuple[Any, ...]:
        """The forward's positional inputs."""
        first = () if self.x is None else (self.x,)
        return first if not self.own_loss or self.target is None else (*first, self.target)

    def forward(self, model: Callable[..., Any]) -> Any:
        """``model`` called on this batch (the loss's own inputs included)."""
        return model(*self.args(), **self.kwargs, **self.loss_kwargs)

    def loss(self, out: Any) -> torch.Tensor:
        """The loss of ``out``, what ``model`` returned for this batch."""
        if self.loss_fn is not None:
            return self.weigh(self.loss_fn(out, self.target), self.target)
        return loss_of(out)

    def weigh(self, loss: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """``loss_fn``'s ``loss`` on ``target`` (a part of this call's, or all of it), a mean over its counted
        targets, as its share of the replica's loss: their sum over :attr:`items`; unchanged where ``items`` is
        None. A target with none counted adds 0 (its mean is nan)."""
        if self.items is None:
            return loss
        count = counted(target)
        return torch.where(count > 0, loss * count / self.items, torch.zeros_like(loss))

    def first_tensor(self) -> torch.Tensor | None:
        """The first tensor of the inputs (``x``'s, else the keyword inputs'), None when they hold none."""
        return next((t for t in tree_leaves((self.x, dict(self.kwargs))) if isinstance(t, torch.Tensor)), None)


def counted(target: torch.Tensor) -> torch.Tensor:
    """How many of a token loss's integer ``target`` it averages over: those not below zero (torch's cross-entropy
    ignores -100 by default, nanoGPT's -1; any other negative target fails that loss, so the two agree wherever it
    is defined). A floating target counts every element (a fill on its device: no copy from the host)."""
    if target.is_floating_point():
        return torch.full((), target.numel(), dtype=torch.long, device=target.device)
    return target.ge(0).sum()


def find_loss(out: Any) -> torch.Tensor | None:
    """The loss a model returned, or None: ``out.loss`` (a transformers ``ModelOutput``), ``out["loss"]``, the one
    0-dimensional floating tensor of a tuple (nanoGPT's ``(logits, loss)``, transformers' ``return_dict=False``), or
    ``out`` itself when it is one. A tuple holding several is a one-line error: which is the loss is unclear."""
    if isinstance(out, torch.Tensor):
        return out if out.dim() == 0 else None
    if isinstance(out, Mapping):
        found = out.get("loss")
    elif isinstance(out, (tuple, list)):
        scalars = [t for t in out if isinstance(t, torch.Tensor) and t.dim() == 0 and t.is_floating_point()]
        if len(scalars) > 1:
            raise ConfigError(
                f"the model returned a {type(out).__name__} holding {len(scalars)} scalars, so which "
                "is the loss is unclear; give forward_backward a loss_fn that picks it"
            )
        found = scalars[0] if scalars else None
    else:
        found = getattr(out, "loss", None)
    return found if isinstance(found, torch.Tensor) and found.dim() == 0 else None


def loss_of(out: Any) -> torch.Tensor:
    """:func:`find_loss`, or a one-line error saying how to pass the targets or a loss function."""
    found = find_loss(out)
    if found is None:
        raise ConfigError(
            f"the model returned {type(out).__name__} without a loss; pass the targets it computes its "
            "loss from (forward_backward(model, x, y) calls model(x, y); labels=y is handed on as a "
            "keyword) or give a loss_fn"
        )
    return found
