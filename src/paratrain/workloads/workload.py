"""What a workload is (a model builder, a loss and a seeded batch maker) and the one registry of their names.

``paratrain bench`` and the benchmarks run a workload by name: ``mlp``, ``cnn`` and ``gpt-tiny`` are built in
(:mod:`paratrain.workloads.synthetic`); anything else is ``module:factory``, a function of the user's that
returns a :class:`Workload` or a ``(model, loss, make_batch)`` tuple.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ConfigError
from ..factory import load_callable

Batch = tuple[torch.Tensor, torch.Tensor]
MakeBatch = Callable[[int, torch.Generator], Batch]
"""``make_batch(samples, generator) -> (inputs, targets)``: random data drawn from ``generator``."""


def sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """The default optimizer of a workload: plain SGD, lr 0.01 (cheap, so the step time is the model's)."""
    return torch.optim.SGD(params, lr=0.01)


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A training job that needs no data on disk: build the model, draw a batch, compute the loss."""

    name: str
    """How reports name it."""
    model: Callable[[], nn.Module]
    """Builds a fresh model; called after seeding, so every rank builds the same weights."""
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """``loss(outputs, targets)``, a scalar mean over the batch."""
    make_batch: MakeBatch
    """Draws ``samples`` inputs and targets from the generator it is given (seeded per rank)."""
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] = sgd
    """Builds the optimizer over the model's parameters."""
    description: str = ""
    """One line for reports: the model's shape and the data."""
    tp_plan: Mapping[str, str] | None = None
    """Its tensor-parallel plan (module-name patterns → styles) when the model has no built-in one; None: the
    built-in plan (GPT-2, Llama, our GPT), or none."""

    def __post_init__(self) -> None:
        for field in ("model", "loss", "make_batch", "optimizer"):
            if not callable(getattr(self, field)):
                raise ConfigError(f"workload {self.name!r}: {field} must be callable, got {getattr(self, field)!r}")


def builtin_workloads() -> dict[str, Callable[[], Workload]]:
    """Built-in names → constructors (imported here so that the registry is the one list of names)."""
    from .synthetic import cnn_workload, gpt_tiny_workload, mlp_workload

    return {"mlp": mlp_workload, "cnn": cnn_workload, "gpt-tiny": gpt_tiny_workload}


def workload_names() -> list[str]:
    return list(builtin_workloads())


def get_workload(name: str) -> Workload:
    """The built-in workload ``name``, or the one ``module:factory`` returns; anything else is a one-line error."""
    builtins = builtin_workloads()
    if name in builtins:
        return builtins[name]()
    if ":" not in name:
        raise ConfigError(f"unknown workload {name!r}; choose one of: {', '.join(builtins)}, or module:factory")
    made = load_callable(name, "workload")()
    if isinstance(made, Workload):
        return made
    if isinstance(made, tuple) and len(made) == 3:
        model, loss, make_batch = made
        return Workload(name=name, model=_builder(model), loss=loss, make_batch=make_batch)
    raise ConfigError(f"workload {name!r} returned {type(made).__name__}; return a paratrain.workloads.Workload or a "
                      "(model, loss, make_batch) tuple")


def _builder(model: nn.Module | Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """A model builder from a factory's model: a callable as it is, a module copied afresh for every use."""
    if isinstance(model, nn.Module):
        return lambda: copy.deepcopy(model)
    if callable(model):
        return model
    raise ConfigError(f"a workload's model must be an nn.Module or a function building one, got {type(model).__name__}")
