"""What ``Parallel.prepare`` has handed back: the wrapped models (each with the facts it held before it was
wrapped), their optimizers, the LR schedulers built on them and the sharded loaders.

Checkpoints save and restore exactly these, so they live together in one object; ``Parallel`` keeps the verbs
that wrap them, this module keeps the bookkeeping and the rule for sorting ``prepare``'s arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from .checkpoint.io import Targets
from .distributed.metrics import gather_object
from .distributed.pipeline import no_graph
from .errors import ConfigError
from .model.facts import ModelFacts
from .strategies.base import Runtime, Strategy

Optimizer = torch.optim.Optimizer
Scheduler = torch.optim.lr_scheduler.LRScheduler


class Prepared:
    """Everything prepared so far, in the order ``prepare`` saw it."""

    def __init__(self) -> None:
        self.models: list[nn.Module] = []
        self.facts: dict[int, ModelFacts] = {}  # id(prepared model) -> what it held before wrapping
        self.optimizers: list[tuple[nn.Module, Optimizer]] = []
        self.schedulers: list[Scheduler] = []
        self.loaders: list[DataLoader] = []

    def check_graph(self, loss: torch.Tensor, strategy: str) -> None:
        """One line, before ``backward``, for a loss that has no graph to back-propagate through."""
        if not loss.requires_grad:
            raise ConfigError(no_graph(self.models, strategy))

    def add_model(self, wrapped: nn.Module, facts: ModelFacts) -> nn.Module:
        self.facts[id(wrapped)] = facts
        self.models.append(wrapped)
        return wrapped

    def add_optimizer(
        self, strategy: Strategy, model: nn.Module, optimizer: Optimizer, runtime: Callable[[ModelFacts], Runtime]
    ) -> Optimizer:
        """Wrap ``optimizer`` for the prepared ``model``, checked to train that model's parameters before and
        after (a wrapper that rebuilt the parameters must have rebuilt the optimizer's groups alike)."""
        facts = self.facts[id(model)]
        facts.check_source(optimizer)
        wrapped = strategy.wrap_optimizer(optimizer, model, runtime(facts))
        facts.check_kept(optimizer, wrapped, strategy.unwrap(model), strategy.name)
        self.optimizers.append((model, wrapped))
        return wrapped

    def add_scheduler(self, scheduler: Scheduler) -> Scheduler:
        """Keep ``scheduler`` for checkpoints; it must step an optimizer ``prepare`` returned, or a resume would
        restore a schedule that drives nothing."""
        if not any(scheduler.optimizer is opt for _, opt in self.optimizers):
            raise ConfigError(
                "this LR scheduler is not built on an optimizer that prepare() returned; prepare the "
                "optimizer first, then build the scheduler on the returned one and pass it to prepare()"
            )
        self.schedulers.append(scheduler)
        return scheduler

    def add_loader(self, loader: DataLoader) -> None:
        self.loaders.append(loader)

    def targets(self, strategy: Strategy, precision: Any, **position: Any) -> Targets:
        """What a checkpoint saves or restores: these objects plus ``position`` (step, epoch, rank, …)."""
        group = strategy.server.checkpoint_group()
        if group is not None:  # not every rank saves (a parameter server's workers do, for their servers too)
            position["gather"] = partial(gather_object, group=group)
        return Targets(
            strategy=strategy,
            models=self.models,
            optimizers=self.optimizers,
            schedulers=self.schedulers,
            loaders=self.loaders,
            precision=precision,
            **position,
        )


def prepare_each(
    objects: tuple[Any, ...],
    *,
    model: Callable[[nn.Module, Optimizer | None, DataLoader | None], nn.Module],
    optimizer: Callable[[nn.Module, Optimizer], Optimizer],
    loader: Callable[[DataLoader], DataLoader],
    scheduler: Callable[[Scheduler], Scheduler],
) -> Any:
    """``prepare``'s arguments, each handed to the verb for its kind, in order; one object back alone, several as
    a tuple. A model is given the optimizer that follows it and the first loader after it (``auto`` plans that
    optimizer's states and that loader's batch); an optimizer goes with the model before it."""
    out: list[Any] = []
    current: nn.Module | None = None
    for i, obj in enumerate(objects):
        if isinstance(obj, nn.Module):
            after = next((o for o in objects[i + 1 :] if isinstance(o, (nn.Module, Optimizer))), None)
            loader_after = next((o for o in objects[i + 1 :] if isinstance(o, DataLoader)), None)
            current = model(obj, after if isinstance(after, Optimizer) else None, loader_after)
            out.append(current)
        elif isinstance(obj, Optimizer):
            if current is None:
                raise ConfigError("prepare() got an optimizer before any model; pass the model first")
            out.append(optimizer(current, obj))
        elif isinstance(obj, DataLoader):
            out.append(loader(obj))
        elif isinstance(obj, Scheduler):
            out.append(scheduler(obj))
        else:
            raise ConfigError(
                f"prepare() takes nn.Module, torch.optim.Optimizer, DataLoader and LR scheduler "
                f"objects, got {type(obj).__name__}"
            )
    return out[0] if len(out) == 1 else tuple(out)
