"""A model's output head, what it reads, and the hooks that compute the loss there instead of the logits.

The head is found by watching one plain run: the last ``nn.Linear`` called, and the module whose output it reads
(the final norm). Both are needed because a model decides itself what its head sees: nanoGPT without targets and
transformers with ``logits_to_keep=1`` hand it the last position only, while the norm before it still computes all
of them.

While the hooks are armed, the model runs as it would without its targets, except at the head: its call computes the
loss from the norm's output (every position) and returns a zero-stride stand-in for the logits, which costs no
memory. The loss is computed inside the head's own call because wrappers prepare a module's parameters for its
call only (FSDP gathers the head's weight then and reshards it after), and it leaves the model as a second output of
the root module, so the wrappers around the root see it: FSDP starts its backward from there and DDP finds the
parameters it used.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from ..errors import ConfigError

T = TypeVar("T")
Compute = Callable[[torch.Tensor, nn.Linear], torch.Tensor]


@dataclass(frozen=True)
class Head:
    """The output layer of a model and the module whose output it reads."""

    layer: nn.Linear
    feeder: nn.Module


def find_head(root: nn.Module, run: Callable[[], T]) -> tuple[Head | str, T]:
    """``run()``'s result (a plain forward of ``root``, possibly wrapped) and ``root``'s head, or why none was found:
    the last ``nn.Linear`` called, and the latest module to finish before it whose output is a tensor, which must
    be exactly what the head was handed (no operation of the model's between them but a cast)."""
    finished: list[tuple[nn.Module, Any]] = []
    last: list[tuple[nn.Linear, Any, int]] = []

    def before(module: nn.Module, args: tuple) -> None:
        if isinstance(module, nn.Linear) and args:
            last[:] = [(module, args[0], len(finished))]

    def after(module: nn.Module, args: tuple, out: Any) -> None:
        finished.append((module, out))

    handles = [
        h
        for m in root.modules()
        if m is not root
        for h in (m.register_forward_pre_hook(before), m.register_forward_hook(after))
    ]
    try:
        result = run()
    finally:
        for handle in handles:
            handle.remove()
    if not last:
        return "it calls no nn.Linear output layer", result
    layer, seen, at = last[0]
    feeder = next(((m, out) for m, out in reversed(finished[:at]) if isinstance(out, torch.Tensor)), None)
    if (
        feeder is None
        or not isinstance(seen, torch.Tensor)
        or feeder[1].shape != seen.shape
        or not torch.equal(feeder[1].to(seen.dtype), seen)
    ):  # FSDP's mixed precision casts what a unit is handed
        return "its output layer does not read a module's output as it is", result
    return Head(layer, feeder[0]), result


class Armed:
    """What one armed forward computed at the head."""

    def __init__(self) -> None:
        self.hidden: torch.Tensor | None = None
        self.loss: torch.Tensor | None = None
        self.paired = False
        """The root's hook returned ``(output, loss)``."""

    def taken(self, out: Any) -> torch.Tensor:
        """The loss from what the prepared model returned: ``(output, loss)``, the root's hook having added it (the
        wrappers may have replaced the tensor on the way: DDP does, to find the parameters it used)."""
        if not self.paired:
            raise ConfigError(
                "loss_chunk: the model never called its output layer when run without its targets; "
                "drop loss_chunk for this model"
            )
        return out[1]


@contextmanager
def armed(root: nn.Module, head: Head, compute: Compute) -> Iterator[Armed]:
    """Within: ``root``'s head computes ``compute(hidden states, head)`` instead of logits (see the module
    docstring), and ``root`` returns ``(its output, that loss)``."""
    state = Armed()
    layer = head.layer

    def keep(_: nn.Module, args: tuple, out: torch.Tensor) -> None:
        state.hidden = out

    def stand_in(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if state.loss is None and state.hidden is not None:  # as the head is handed it: device, FSDP's cast
            state.loss = compute(state.hidden.to(x.device, x.dtype), layer)
        return torch.zeros((), dtype=x.dtype, device=x.device).expand(*x.shape[:-1], layer.out_features)

    def pair(_: nn.Module, args: tuple, out: Any) -> Any:
        if state.loss is None:
            return out
        state.paired = True
        return out, state.loss

    handles = [head.feeder.register_forward_hook(keep), root.register_forward_hook(pair, prepend=True)]
    own = layer.__dict__.get("forward")  # a forward patched onto the instance by someone else, put back after
    layer.forward = stand_in  # type: ignore[method-assign]
    try:
        yield state
    finally:
        if own is None:
            del layer.forward
        else:
            layer.forward = own
        for handle in handles:
            handle.remove()
        state.hidden = None
