"""The one registry of workload names.

``paratrain bench`` and the benchmarks run a workload by name: ``mlp``, ``cnn``, ``gpt-tiny`` and ``gpt-moe-tiny``
(:mod:`paratrain.workloads.synthetic`) and ``recommender`` and ``recommender-tiny``
(:mod:`paratrain.workloads.recommender`) are built in; anything else is ``module:factory``, a function of the user's
that returns a :class:`~paratrain.workloads.workload.Workload` or a ``(model, loss, make_batch)`` tuple.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

from torch import nn

from ..errors import ConfigError
from ..factory import load_callable
from .recommender import recommender_tiny_workload, recommender_workload
from .synthetic import (
    cnn_workload,
    gpt_moe_tiny_workload,
    gpt_tiny_workload,
    mlp_workload,
)
from .workload import Workload

_BUILT_IN: dict[str, Callable[[], Workload]] = {
    "mlp": mlp_workload,
    "cnn": cnn_workload,
    "gpt-tiny": gpt_tiny_workload,
    "gpt-moe-tiny": gpt_moe_tiny_workload,
    "recommender": recommender_workload,
    "recommender-tiny": recommender_tiny_workload,
}


def workload_names() -> list[str]:
    return list(_BUILT_IN)


def get_workload(name: str) -> Workload:
    """The built-in workload ``name``, or the one ``module:factory`` returns; anything else is a one-line error."""
    if name in _BUILT_IN:
        return _BUILT_IN[name]()
    if ":" not in name:
        raise ConfigError(f"unknown workload {name!r}; choose one of: {', '.join(_BUILT_IN)}, or module:factory")
    made = load_callable(name, "workload")()
    if isinstance(made, Workload):
        return made
    if isinstance(made, tuple) and len(made) == 3:
        model, loss, make_batch = made
        return Workload(name=name, model=_builder(model), loss=loss, make_batch=make_batch)
    raise ConfigError(
        f"workload {name!r} returned {type(made).__name__}; return a paratrain.workloads.Workload or a "
        "(model, loss, make_batch) tuple"
    )


def _builder(model: nn.Module | Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """A model builder from a factory's model: a callable as it is, a module copied afresh for every use."""
    if isinstance(model, nn.Module):
        return lambda: copy.deepcopy(model)
    if callable(model):
        return model
    raise ConfigError(f"a workload's model must be an nn.Module or a function building one, got {type(model).__name__}")
