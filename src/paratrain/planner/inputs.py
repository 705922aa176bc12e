"""What the planner feeds a model it runs (to trace, measure or time it): one sample's input, and the call a training
loop makes with it.

A training loop often calls a model otherwise than inference does. nanoGPT's ``forward(idx, targets=None)`` computes
every position's logits and the loss only when given targets; without them it computes the last position's logits
alone, for generation, a quarter of its training FLOPs and memory short at 124M parameters. transformers' causal LMs
compute their loss when given ``labels=``. So the planner calls a forward the way training does
(:class:`TrainingCall`): with targets when the forward takes a parameter of a target's name (``TARGET_NAMES``), taking
the loss the model returns; otherwise on its input alone, with the planner's own loss over its output. When that
output is not per token (its sequence shorter than the input's), the figures miss what training computes, and
:meth:`Forward.warning` says so.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..batch import find_loss
from ..errors import ConfigError

TARGET_NAMES = ("targets", "labels", "target", "label", "y", "tgt")
"""Names of a forward's parameter that takes the targets: nanoGPT's ``targets``, transformers' ``labels``, …"""


@dataclass(frozen=True, kw_only=True)
class InputSpec:
    """One sample's input: its shape and dtype (token ids are ``long``); an empty shape is one value a sample."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    high: int | None = None
    """Token ids are drawn below this (a vocabulary's size); None: all zero. Timing wants real ids: the
    embedding's backward on one repeated id serialises on that row."""

    def __post_init__(self) -> None:
        if any(d < 1 for d in self.shape):
            raise ConfigError(f"input shape must have sizes >= 1, got {self.shape}")

    @classmethod
    def parse(cls, text: str) -> InputSpec:
        """``3x224x224`` (float32), ``long:1024`` (token ids), ``float16:8x8``, or ``long`` (one id a sample)."""
        dtype_name, _, dims = text.rpartition(":")
        if not dtype_name and isinstance(getattr(torch, dims, None), torch.dtype):
            dtype_name, dims = dims, ""
        dtype = getattr(torch, dtype_name or "float32", None)
        if not isinstance(dtype, torch.dtype):
            raise ConfigError(f"unknown input dtype {dtype_name!r} in {text!r}; use e.g. float32 or long")
        try:
            shape = tuple(int(d) for d in dims.lower().split("x")) if dims else ()
        except ValueError:
            raise ConfigError(
                f"bad input shape {text!r}; write one sample's shape like 3x224x224 or long:1024"
            ) from None
        return cls(shape=shape, dtype=dtype)

    @property
    def is_ids(self) -> bool:
        """Integer ids (tokens), not values."""
        return not self.dtype.is_floating_point and self.dtype is not torch.bool

    def make(self, batch: int, device: str | torch.device) -> torch.Tensor:
        if self.dtype.is_floating_point:
            return torch.randn(batch, *self.shape, dtype=self.dtype, device=device)
        if self.high is None:
            return torch.zeros(batch, *self.shape, dtype=self.dtype, device=device)
        return torch.randint(0, self.high, (batch, *self.shape), dtype=self.dtype, device=device)


@dataclass(frozen=True, kw_only=True)
class Forward:
    """One forward as training makes it: what backward starts from, and the output the loss reads."""

    loss: torch.Tensor
    """The model's own loss, else the planner's stand-in (the sum of ``output``)."""
    output: torch.Tensor
    """The largest output the loss reads: the logits (or the only tensor the model returns)."""
    own_loss: bool
    """``loss`` is the model's: what it saved for backward is traced. False: the planner adds a cross-entropy's
    fp32 log-probabilities over ``output``."""

    def warning(self, x: torch.Tensor, name: str) -> str | None:
        """A line when the output is not per token: token ids in, a sequence out shorter than theirs, and no loss of
        the model's to say that this is what training computes. None otherwise."""
        if self.own_loss or x.is_floating_point() or x.dim() < 2 or self.output.dim() < 3:
            return None
        given, got = x.shape[1], self.output.shape[1]
        if got >= given:
            return None
        return (
            f"{name}'s traced output has {got} position{'s' if got > 1 else ''} a sample for {given} input tokens: "
            "not per token (an inference path?), so its FLOPs and memory are short of training's; let its forward "
            f"take targets (a parameter named {' or '.join(TARGET_NAMES[:2])}; --targets gives their shape), or "
            "plan a factory whose forward returns every position"
        )


@dataclass(frozen=True, kw_only=True)
class TrainingCall:
    """How the planner calls a model: as training does, on ``input`` and, when the forward takes targets (a parameter
    named in ``TARGET_NAMES``), on targets, taking the loss the model returns (``.loss``, ``["loss"]``, or the only
    0-dim tensor of a tuple)."""

    input: InputSpec
    targets: InputSpec | None = None
    """One sample's targets (``--targets long:1024``); None: one per input token for token ids (below the same
    vocabulary), else one class id a sample."""
    plain: bool = False
    """Call the model on its input alone (``--targets none``), even when its forward takes targets."""
    document_tokens: int | None = None
    """The input's rows are packed with documents of this many tokens (``Training.document_tokens``): a trace counts
    each attention call's FLOPs per document (:func:`.attention.attention_flops`); the call itself is unchanged."""

    def __post_init__(self) -> None:
        if self.plain and self.targets is not None:
            raise ConfigError("targets given for a call on the input alone; give one of them")

    @classmethod
    def parse(cls, example: InputSpec, targets: str | None = None) -> TrainingCall:
        """``example`` with ``--targets``: one sample's shape, ``none`` (the input alone) or None (found)."""
        if targets is not None and targets.strip().lower() == "none":
            return cls(input=example, plain=True)
        return cls(input=example, targets=None if targets is None else InputSpec.parse(targets))

    @classmethod
    def of(cls, example: InputSpec | TrainingCall) -> TrainingCall:
        """``example`` as a call: an input alone is called as training calls it (targets found)."""
        return example if isinstance(example, TrainingCall) else cls(input=example)

    def target_spec(self) -> InputSpec:
        """The targets given, else found from the input (see ``targets``)."""
        if self.targets is not None:
            return self.targets
        if self.input.is_ids and self.input.shape:
            return InputSpec(shape=self.input.shape, dtype=torch.long, high=self.input.high)
        return InputSpec(shape=(), dtype=torch.long)

    def inputs(
        self, model: nn.Module, batch: int, device: str | torch.device
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The input of ``batch`` samples made on ``device``, and the targets ``model``'s forward takes, by name."""
        x = self.input.make(batch, device)
        name = None if self.plain else target_parameter(model)
        if name is None:
            if self.targets is not None:
                raise ConfigError(
                    f"--targets: {type(model).__name__}.forward takes no targets (no parameter named "
                    f"{', '.join(TARGET_NAMES)}); drop --targets"
                )
            return x, {}
        return x, {name: self.target_spec().make(batch, device)}

    def run(self, model: nn.Module, batch: int, device: str | torch.device) -> tuple[torch.Tensor, Forward]:
        """(the input, the forward) of one call on ``batch`` samples made on ``device``."""
        x, targets = self.inputs(model, batch, device)
        return x, forward_of(model(x, **targets))


def target_parameter(model: nn.Module) -> str | None:
    """The name of the parameter of ``model``'s forward that takes targets, or None."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # a builtin or C++ forward has no signature to read
        return None
    return next((n for n in TARGET_NAMES if n in params), None)


def forward_of(out: object) -> Forward:
    """The loss and the logits in what a forward returned (see ``TrainingCall``)."""
    loss = find_loss(out)
    output = output_tensor(out)
    if loss is None:
        return Forward(loss=output.float().sum(), output=output, own_loss=False)
    return Forward(loss=loss, output=output, own_loss=True)


def output_tensor(out: object) -> torch.Tensor:
    """The output a loss reads: the tensor returned, or the first of a tuple, list or dict with a batch dimension
    (the logits beside a loss)."""
    if isinstance(out, torch.Tensor):
        return out
    values = out.values() if isinstance(out, Mapping) else out if isinstance(out, (tuple, list)) else ()
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    batched = [t for t in tensors if t.dim() > 0]
    if batched or tensors:
        return (batched or tensors)[0]
    raise ConfigError(f"the model returned {type(out).__name__}, not a tensor (or a tuple/dict holding one)")
