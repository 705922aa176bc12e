"""What the user hands ``paratrain verify``: their model, optimizer, loss, loader, ``Parallel`` options and
(optionally) their loop.

``paratrain verify mymodule:build`` calls ``build()`` on every rank and in the single-process reference, so it
must build everything the way the training script does (its seeding and initialisation included):

    def build() -> paratrain.verify.VerifySpec:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
        data = TensorDataset(torch.randn(256, 8), torch.randint(0, 4, (256,)))
        return VerifySpec(model=model, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                          loss=F.cross_entropy, loader=DataLoader(data, batch_size=16, shuffle=True),
                          options={"clip_grad_norm": 1.0},   # what the script gives Parallel
                          train=my_training_loop)            # optional: the script's own loop

A model that computes its own loss (nanoGPT's ``model(x, y) -> (logits, loss)``, transformers' ``labels=``) takes
``loss=None``; an optimizer built from the model (nanoGPT's ``configure_optimizers``) comes through
``optimizer_from_model``.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from ..errors import ConfigError, ParatrainError
from ..factory import load_callable
from ..parallel import Parallel
from .options import RunOptions

Loss = Callable[[Any, torch.Tensor], torch.Tensor]
TrainLoop = Callable[[Parallel, nn.Module, torch.optim.Optimizer, DataLoader, Loss | None], None]


def paratrain_loop(
    par: Parallel,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: DataLoader,
    loss: Loss | None,
    *,
    target_keyword: str | None = None,
) -> None:
    """The canonical loop: a sharded loader, reshuffled every epoch, ``par.step`` around ``forward_backward``.
    With ``loss`` None the model computes its own loss: from ``model(x, y)``, or with ``target_keyword`` from
    ``model(x, **{target_keyword: y})`` (transformers' ``labels=``)."""
    loader = par.prepare_loader(loader)
    for _ in par.epochs(sys.maxsize):  # verify stops the loop after its steps
        for x, y in loader:
            with par.step(model, optimizer):
                y = y.to(par.device)
                par.forward_backward(model, x.to(par.device), {target_keyword: y} if target_keyword else y, loss)


@dataclass(kw_only=True)
class VerifySpec:
    """A training setup to check: built identically by the factory on every rank and in the reference."""

    model: nn.Module
    """The model as the script builds it, before ``prepare`` (with the script's seeding and initialisation)."""
    loss: Loss | None
    """``loss(outputs, targets)``, a mean over the batch; None: the model computes its own loss from the targets
    (``model(x, y)`` returning it, or ``target_keyword``) and returns it (:func:`paratrain.batch.find_loss`)."""
    loader: DataLoader | None
    """The training loader over a map-style dataset, at the per-rank micro-batch size, as the script builds it
    (the loop decides whether to shard it); None for a ``train`` loop that reads from something else (a loader class
    of its own): verify then replays what the loop fed the model (:mod:`paratrain.verify.reference`)."""
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None
    """Builds the optimizer over the model's parameters, e.g. ``lambda p: torch.optim.AdamW(p, lr=1e-3)``."""
    optimizer_from_model: Callable[[nn.Module], torch.optim.Optimizer] | None = None
    """Instead of ``optimizer``: builds it from the model itself, for parameter groups the model decides, e.g.
    ``lambda m: m.configure_optimizers(0.1, 6e-4, (0.9, 0.95), "cpu")`` (nanoGPT). Called before ``prepare``, as
    the script calls it."""
    accumulate: int = 1
    """Micro-batches per optimizer step (``Parallel(accumulate=...)``)."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """Any other keyword the script gives ``Parallel`` (``clip_grad_norm``, ``seed``, ``precision``,
    ``global_batch``, ``tp_plan``…): its own keywords reach both runs, strategy options the parallel run alone
    (:mod:`paratrain.verify.options`)."""
    target_keyword: str | None = None
    """With ``loss=None``: the forward's keyword the targets go to, e.g. ``"labels"`` (transformers); None: the
    second positional argument (nanoGPT's ``model(idx, targets)``)."""
    train: TrainLoop | None = None
    """The script's loop, ``train(par, model, optimizer, loader, loss)``, called with the prepared model and
    optimizer, the loader as built and ``loss`` (None when the model computes it), in the parallel run and in the
    one-process reference alike (there the loader yields the global batches); it may loop for ever, verify stops it.
    None: :func:`paratrain_loop`."""
    run_options: RunOptions = field(init=False, repr=False)
    """``options`` sorted by the run each reaches."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, nn.Module):
            raise ConfigError(f"VerifySpec.model must be an nn.Module, got {type(self.model).__name__}")
        self._check_loader()
        self._check_callables()
        if not isinstance(self.accumulate, int) or self.accumulate < 1:
            raise ConfigError(f"VerifySpec.accumulate must be an integer >= 1, got {self.accumulate!r}")
        micro_batch = self.loader.batch_size if self.loader is not None else None
        self.run_options = RunOptions.of(self.options, accumulate=self.accumulate, micro_batch=micro_batch)

    def _check_loader(self) -> None:
        if self.loader is None:
            if self.train is None:
                raise ConfigError(
                    "VerifySpec(loader=None) needs train=: your loop, reading from your own data (the canonical loop "
                    "reads the loader)"
                )
            return
        if not isinstance(self.loader, DataLoader):
            raise ConfigError(f"VerifySpec.loader must be a torch DataLoader, got {type(self.loader).__name__}")
        if not hasattr(self.loader.dataset, "__len__") or not hasattr(self.loader.dataset, "__getitem__"):
            raise ConfigError(
                "verify needs a map-style dataset (with __len__ and __getitem__) to know which samples each rank read"
            )
        if self.loader.batch_size is None:
            raise ConfigError("verify needs a DataLoader with a batch_size (not a custom batch_sampler)")

    def _check_callables(self) -> None:
        if (self.optimizer is None) == (self.optimizer_from_model is None):
            raise ConfigError(
                "VerifySpec takes one of optimizer (built over the parameters) and optimizer_from_model "
                "(built from the model, e.g. its configure_optimizers)"
            )
        for name in ("optimizer", "optimizer_from_model", "loss", "train"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise ConfigError(f"VerifySpec.{name} must be callable")
        if self.target_keyword is not None and (self.loss is not None or not str(self.target_keyword).isidentifier()):
            raise ConfigError(
                f"VerifySpec.target_keyword={self.target_keyword!r}: a keyword of the model's forward "
                "(e.g. 'labels') for a model that computes its own loss (loss=None)"
            )
        if self.loss is None and not _takes_targets(self.model, self.target_keyword):
            where = f"no keyword {self.target_keyword!r}" if self.target_keyword else "no second argument"
            raise ConfigError(
                f"VerifySpec(loss=None) has the model compute its loss from the targets, but "
                f"{type(self.model).__name__}.forward takes {where} for them; give a loss function, "
                "or target_keyword= naming the forward's keyword for the targets"
            )

    def build_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer over ``model`` as it is now (before ``prepare``), from whichever factory was given."""
        made = (
            self.optimizer(self.model.parameters())
            if self.optimizer is not None
            else self.optimizer_from_model(self.model)
        )  # type: ignore[misc]
        if not isinstance(made, torch.optim.Optimizer):
            raise ConfigError(
                f"the VerifySpec's optimizer factory returned {type(made).__name__}; return a torch.optim.Optimizer"
            )
        return made

    @property
    def loop(self) -> TrainLoop:
        if self.train is not None:
            return self.train
        return functools.partial(paratrain_loop, target_keyword=self.target_keyword)


def _takes_targets(model: nn.Module, keyword: str | None) -> bool:
    """Whether ``model``'s forward can take the targets: as its second argument, or as ``keyword``."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):  # no signature to read: let the call say
        return True
    kinds = {p.kind for p in params}
    if keyword is not None:
        return inspect.Parameter.VAR_KEYWORD in kinds or any(p.name == keyword for p in params)
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return inspect.Parameter.VAR_POSITIONAL in kinds or sum(p.kind in positional for p in params) >= 2


def build_spec(factory: str) -> VerifySpec:
    """Call ``module:factory`` and check that it returned a ``VerifySpec``."""
    build = load_callable(factory, "verify factory")
    try:
        spec = build()
    except ParatrainError:
        raise
    except Exception as err:  # the user's own code: one line saying so; --debug shows where
        raise ConfigError(
            f"{factory}() raised {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''} "
            "(run it alone, or paratrain --debug verify, for its traceback)"
        ) from err
    if not isinstance(spec, VerifySpec):
        raise ConfigError(f"{factory} returned {type(spec).__name__}; return a paratrain.verify.VerifySpec")
    return spec
