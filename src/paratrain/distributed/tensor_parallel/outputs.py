"""What a tensor-parallel model hands back, and the loss over logits that stay split.

The output head keeps its logits split over the vocabulary (a ``Shard(-1)`` DTensor). Inside
``Parallel.forward_backward`` they stay so, and the loss and its backward run under PyTorch's ``loss_parallel``:
each rank computes the softmax's pieces over its slice of the vocabulary and only per-token sums cross the
ranks, never the ``batch x seq x vocab`` logits — also a loss the model computes inside its own ``forward``
(transformers' ``labels=``, nanoGPT's ``model(x, y)``). Anywhere else — a script calling ``model(x, y)`` itself,
evaluation — the logits are gathered into a plain full tensor right at the head, so the model's own code after it
and the code that reads its outputs get the values one process computes (and a correct gradient: every rank of the
group computes the same loss from the same logits).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils._pytree import tree_map

from ...batch import ModelCall


class ShardedOutputs:
    """Gathers a model's DTensor outputs into plain tensors, except inside ``kept()``."""

    def __init__(self) -> None:
        self._keep = False
        self.gather_heads = False
        """The model's own code after the head failed on split logits: gathered there from now on."""
        self.split_handed_out = False
        """The head handed out split logits in this forward (so a failure after it is the model's code on them)."""

    def install(self, model: nn.Module) -> None:
        """Gather what ``model`` returns (its hidden states, a loss computed on split logits)."""
        model.register_forward_hook(self._hook)

    def install_head(self, head: nn.Module) -> None:
        """Gather the logits of the output ``head`` right where it computes them, so the model's own code after it
        (a loss computed inside ``forward``) reads plain logits: correct values with a correct gradient."""
        head.register_forward_hook(self._head_hook)

    def _hook(self, module: nn.Module, args: Any, out: Any) -> Any:
        if self._keep:
            return out
        return tree_map(plain, out)

    def _head_hook(self, module: nn.Module, args: Any, out: Any) -> Any:
        if self._keep and not self.gather_heads:
            self.split_handed_out = True
            return out
        return plain(out)

    @contextmanager
    def kept(self) -> Iterator[None]:
        self._keep = True
        try:
            yield
        finally:
            self._keep = False

    @contextmanager
    def split_loss(self) -> Iterator[None]:
        """Forward, loss and backward on the logits left split over the vocabulary, under ``loss_parallel``."""
        with self.kept(), loss_parallel():
            yield


def plain(t: torch.Tensor) -> torch.Tensor:
    """A DTensor output (logits, a loss computed under ``loss_parallel``) as a plain full tensor. Gathering a split
    the ranks hold unevenly (a vocabulary of 65 over 2) ends in a slice, a view, which FSDP2 warns about when the
    root module returns it (an in-place op on it would drop FSDP's pre-backward hook): a view is copied once, next
    to the gather it follows."""
    if not isinstance(t, DTensor):
        return t
    full = t.full_tensor()
    return full.clone() if full._base is not None else full


def forward_backward(
    outputs: ShardedOutputs, model: nn.Module, call: ModelCall, scale: float, precision: Any, device: torch.device
) -> torch.Tensor:
    """The micro-batch ``call``'s loss and its backward with the logits left split (see the module docstring);
    returns the loss as a plain tensor.

    A model that computes its loss itself does so on the split logits when its code can (transformers' and
    nanoGPT's cross-entropy can, under ``loss_parallel``). Where it cannot (an op mixing them with plain tensors),
    the first such micro-batch fails after the head and is run again with the logits gathered at the head, as they
    are from then on: nothing of the failed forward is kept (no backward ran), and the random state is put back so
    the second run draws the same dropout."""
    loss = _split_own_loss(outputs, model, call, precision, device) if call.own_loss else None
    with outputs.split_loss():
        if loss is None:
            loss = precision.loss(model, call, device)
        precision.backward(loss * scale if scale != 1.0 else loss)
    return plain(loss)


def _split_own_loss(
    outputs: ShardedOutputs, model: nn.Module, call: ModelCall, precision: Any, device: torch.device
) -> torch.Tensor | None:
    """The model's own loss on split logits, or None when its code failed on them (from then on they are
    gathered)."""
    if outputs.gather_heads:
        return None
    states = _rng_states(device)
    outputs.split_handed_out = False
    try:
        with outputs.split_loss():
            return precision.loss(model, call, device)
    except (RuntimeError, TypeError, NotImplementedError):
        if not outputs.split_handed_out:
            raise  # it failed before the logits: not their layout's doing
        outputs.gather_heads = True
        _restore_rng(states, device)
        return None


def _rng_states(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _restore_rng(states: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1], device)
