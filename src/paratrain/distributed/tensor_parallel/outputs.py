"""What a tensor-parallel model hands back, and the loss over logits that stay split.

The output head keeps its logits split over the vocabulary (a ``Shard(-1)`` DTensor). Inside
``Parallel.forward_backward`` they stay so, and the loss and its backward run under PyTorch's ``loss_parallel``:
each rank computes the softmax's pieces over its slice of the vocabulary and only per-token sums cross the
ranks, never the ``batch x seq x vocab`` logits. Anywhere else — a script calling ``model(x)`` itself, evaluation —
the model's outputs are gathered into plain full tensors, so code written for one process gets the values it
expects (and a correct gradient: every rank of the group computes the same loss from the same logits).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils._pytree import tree_map


class ShardedOutputs:
    """Gathers a model's DTensor outputs into plain tensors, except inside ``kept()``."""

    def __init__(self) -> None:
        self._keep = False

    def install(self, model: nn.Module) -> None:
        model.register_forward_hook(self._hook)

    def _hook(self, module: nn.Module, args: Any, out: Any) -> Any:
        if self._keep:
            return out
        return tree_map(plain, out)

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


def forward_backward(outputs: ShardedOutputs, model: nn.Module, x: Any, target: Any, loss_fn: Callable,
                     scale: float, precision: Any, device: torch.device) -> torch.Tensor:
    """``loss_fn(model(x), target)`` and its backward with the logits left split (see the module docstring);
    returns the loss as a plain tensor."""
    with outputs.split_loss():
        loss = precision.loss(model, x, target, loss_fn, device)
        precision.backward(loss * scale if scale != 1.0 else loss)
    return plain(loss)
