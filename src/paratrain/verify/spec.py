"""What the user hands ``paratrain verify``: their model, optimizer, loss, loader and (optionally) their loop.

``paratrain verify mymodule:build`` calls ``build()`` on every rank and in the single-process reference, so it
must build everything the way the training script does (its seeding and initialisation included):

    def build() -> paratrain.verify.VerifySpec:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
        data = TensorDataset(torch.randn(256, 8), torch.randint(0, 4, (256,)))
        return VerifySpec(model=model, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                          loss=F.cross_entropy, loader=DataLoader(data, batch_size=16, shuffle=True),
                          train=my_training_loop)   # optional: the script's own loop
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader

from ..errors import ConfigError
from ..parallel import Parallel
from ..factory import load_callable

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
TrainLoop = Callable[[Parallel, nn.Module, torch.optim.Optimizer, DataLoader, Loss], None]


def paratrain_loop(par: Parallel, model: nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader,
                   loss: Loss) -> None:
    """The canonical loop: a sharded loader, reshuffled every epoch, ``par.step`` around ``forward_backward``."""
    loader = par.prepare_loader(loader)
    for _ in par.epochs(sys.maxsize):  # verify stops the loop after its steps
        for x, y in loader:
            with par.step(model, optimizer):
                par.forward_backward(model, x.to(par.device), y.to(par.device), loss)


@dataclass(kw_only=True)
class VerifySpec:
    """A training setup to check: built identically by the factory on every rank and in the reference."""

    model: nn.Module
    """The model as the script builds it, before ``prepare`` (with the script's seeding and initialisation)."""
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
    """Builds the optimizer over the model's parameters, e.g. ``lambda p: torch.optim.AdamW(p, lr=1e-3)``."""
    loss: Loss
    """``loss(outputs, targets)``: a mean over the batch."""
    loader: DataLoader
    """The training loader over a map-style dataset, at the per-rank micro-batch size, as the script builds it
    (the loop decides whether to shard it)."""
    accumulate: int = 1
    """Micro-batches per optimizer step (``Parallel(accumulate=...)``)."""
    train: TrainLoop | None = None
    """The script's loop, ``train(par, model, optimizer, loader, loss)``, called with the prepared model and
    optimizer and the loader as built, in the parallel run and in the one-process reference alike (there the
    loader yields the global batches); it may loop for ever, verify stops it. None: :func:`paratrain_loop`."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, nn.Module):
            raise ConfigError(f"VerifySpec.model must be an nn.Module, got {type(self.model).__name__}")
        if not isinstance(self.loader, DataLoader):
            raise ConfigError(f"VerifySpec.loader must be a torch DataLoader, got {type(self.loader).__name__}")
        if not hasattr(self.loader.dataset, "__len__") or not hasattr(self.loader.dataset, "__getitem__"):
            raise ConfigError("verify needs a map-style dataset (with __len__ and __getitem__) to know which samples "
                              "each rank read")
        if self.loader.batch_size is None:
            raise ConfigError("verify needs a DataLoader with a batch_size (not a custom batch_sampler)")
        for name in ("optimizer", "loss"):
            if not callable(getattr(self, name)):
                raise ConfigError(f"VerifySpec.{name} must be callable")
        if self.train is not None and not callable(self.train):
            raise ConfigError("VerifySpec.train must be a function train(par, model, optimizer, loader, loss)")
        if not isinstance(self.accumulate, int) or self.accumulate < 1:
            raise ConfigError(f"VerifySpec.accumulate must be an integer >= 1, got {self.accumulate!r}")

    @property
    def loop(self) -> TrainLoop:
        return self.train if self.train is not None else paratrain_loop


def build_spec(factory: str) -> VerifySpec:
    """Call ``module:factory`` and check that it returned a ``VerifySpec``."""
    spec = load_callable(factory, "verify factory")()
    if not isinstance(spec, VerifySpec):
        raise ConfigError(f"{factory} returned {type(spec).__name__}; return a paratrain.verify.VerifySpec")
    return spec
