"""The optimizers a server steps: the user's class over its dense parameters, and for each table's rows one that
updates only the rows a step touched (an optimizer that updates every row, Adam's moments, would touch the whole
table every step: refused unless ``table_optimizer`` says what to use instead)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...errors import ConfigError
from ..optimizer import constructor_defaults

_SPARSE_CLASSES = {torch.optim.SGD: "sgd", torch.optim.Adagrad: "adagrad", torch.optim.SparseAdam: "adam"}
_BUILD = {
    "sgd": (torch.optim.SGD, ("lr", "momentum", "dampening", "nesterov", "maximize")),
    "adagrad": (torch.optim.Adagrad, ("lr", "lr_decay", "initial_accumulator_value", "eps", "maximize")),
    "adam": (torch.optim.SparseAdam, ("lr", "betas", "eps", "maximize")),
}


def group_of(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> dict[str, dict[str, Any]]:
    """Each trained parameter name → the hyper-parameters of its group (and the group's index, ``"group"``)."""
    out = {}
    for i, group in enumerate(optimizer.param_groups):
        settings = {**{k: v for k, v in group.items() if k != "params"}, "group": i}
        for p in group["params"]:
            if id(p) not in names:
                raise ConfigError(
                    "the optimizer holds parameters that are not in the prepared model; build it from "
                    "model.parameters() of the model passed to prepare()"
                )
            out[names[id(p)]] = settings
    return out


def table_kind(optimizer: torch.optim.Optimizer, table: str, settings: dict[str, Any], choice: str | None) -> str:
    """Which sparse optimizer updates ``table``'s rows; a dense-only one is refused in one line."""
    kind = choice or _SPARSE_CLASSES.get(type(optimizer))
    if kind is None:
        raise ConfigError(
            f"ps table {table!r} is updated row by row on the servers, but {type(optimizer).__name__} "
            "updates every row each step; pass Parallel('ps', table_optimizer='adam') (SparseAdam), "
            "'adagrad' or 'sgd', or train with SGD/Adagrad"
        )
    if settings.get("weight_decay"):
        raise ConfigError(
            f"ps table {table!r}: weight_decay={settings['weight_decay']} decays every row each step; "
            "put the table in a parameter group with weight_decay=0"
        )
    return kind


def dense_optimizer(
    optimizer: torch.optim.Optimizer, params: dict[str, nn.Parameter], settings: dict[str, dict[str, Any]]
) -> tuple[torch.optim.Optimizer | None, list[int]]:
    """The user's optimizer class and groups over the dense parameters a server owns (None: it owns none), and the
    index of the user's group each of its groups is (a push's learning rates are per user group)."""
    by_group: dict[int, dict[str, Any]] = {}
    for name, p in params.items():
        index = settings[name]["group"]
        if index not in by_group:
            by_group[index] = {k: v for k, v in settings[name].items() if k != "group"} | {"params": []}
        by_group[index]["params"].append(p)
    if not by_group:
        return None, []
    order = sorted(by_group)
    return type(optimizer)([by_group[i] for i in order], **constructor_defaults(optimizer)), order


def set_learning_rates(optimizer: torch.optim.Optimizer | None, groups: list[int], lrs: list[float]) -> None:
    """Give each group of ``optimizer`` (user's group ``groups[i]``) the learning rate the worker pushed."""
    if optimizer is not None:
        for group, index in zip(optimizer.param_groups, groups):
            group["lr"] = lrs[index]


def sparse_optimizer(kind: str, weight: nn.Parameter, settings: dict[str, Any]) -> torch.optim.Optimizer:
    cls, keys = _BUILD[kind]
    return cls([weight], **{k: settings[k] for k in keys if k in settings})
