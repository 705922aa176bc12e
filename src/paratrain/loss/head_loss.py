"""``Parallel(loss_chunk=)``: each micro-batch's loss computed at the model's head in chunks of tokens, so the
``tokens x vocabulary`` logits never exist whole (:mod:`.chunked`), once it is proven to be the loss the model or
the ``loss_fn`` computes (:mod:`.proof`).
"""

from __future__ import annotations

from typing import Any, Protocol
from weakref import WeakKeyDictionary

import torch
from torch import nn

from ..batch import ModelCall
from ..errors import ConfigError
from .proof import Proven, prove
from .recipes import target_key


class Wrapping(Protocol):
    """What a strategy tells the loss: whether it can run at the head, and the user's module in its wrapper."""

    def head_loss_refusal(self) -> str | None: ...

    def unwrap(self, model: nn.Module) -> nn.Module: ...


class HeadLoss:
    """How ``forward_backward`` computes a micro-batch's loss: at the head in chunks of ``chunk`` tokens, or, with
    ``chunk`` None, as the model returns it and the ``loss_fn`` reads it."""

    def __init__(self, chunk: int | None) -> None:
        if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1):
            raise ConfigError(f"loss_chunk must be a whole number of tokens >= 1, or None; got {chunk!r}")
        self.chunk = chunk
        self._proven: WeakKeyDictionary[nn.Module, dict[tuple[bool, str | None], Proven]] = WeakKeyDictionary()

    @property
    def on(self) -> bool:
        """The loss is computed at the head (the strategy's own forward-backward is not used)."""
        return self.chunk is not None

    def __call__(
        self, model: nn.Module, call: ModelCall, strategy: Wrapping, precision: Any, device: torch.device
    ) -> torch.Tensor:
        """The loss of the micro-batch ``call`` on the prepared ``model``, ready for its backward."""
        if self.chunk is None:
            return precision.loss(model, call, device)
        why = strategy.head_loss_refusal()
        if why is not None:
            raise ConfigError(f"loss_chunk does not run here: {why}; drop loss_chunk")
        root = strategy.unwrap(model)
        kinds = self._proven.setdefault(root, {})
        kind = (call.own_loss, target_key(call))  # labels=, model(x, y) and a loss_fn may each be another recipe
        if kind not in kinds:
            kinds[kind] = prove(model, root, call, precision, device, self.chunk)
        return kinds[kind].loss(model, root, call, precision, self.chunk)
