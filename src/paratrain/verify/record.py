"""Evidence a verify run gathers as it trains, the same way in the parallel run and in the reference.

Per optimizer step: the loss of every micro-batch (read from the loss function, or from what the model returns
when it computes its own), the global gradient norm before the step, the full state after it. Once: the channel
means each non-synchronised BatchNorm saw at its first call. And which samples the loader handed out, through a
dataset wrapper that notes every index fetched. Both runs train through the user's loop with a ``Parallel``;
:func:`run_loop` hooks the optimizer and stops the loop after K steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ..batch import find_loss
from ..distributed.grad_norm import global_grad_norm
from ..distributed.pipeline_metadata import FORWARD_FRAMES, LOSS_FRAMES, inside
from ..distributed.tensor_parallel.outputs import plain
from ..parallel import Parallel
from .spec import Loss, VerifySpec


@dataclass(kw_only=True)
class Record:
    """What one process saw, step by step."""

    losses: list[list[float]] = field(default_factory=list)
    """Per optimizer step: the loss of every micro-batch (or pipeline micro-batch) this process computed."""
    grad_norms: list[float] = field(default_factory=list)
    """Per optimizer step: the global gradient norm just before the step."""
    states: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """Per optimizer step: the full state after it (the parallel run keeps rank 0's only)."""
    batchnorm_means: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per non-synchronised BatchNorm: the channel means of its input at its first call."""

    @property
    def steps(self) -> int:
        return len(self.grad_norms)


class RecordHooks:
    """Fills a :class:`Record` from hooks on the user's model and a wrapper around the loss (``own_loss``: a hook
    reading the loss the model returns)."""

    def __init__(self, model: nn.Module, *, own_loss: bool = False) -> None:
        self.record = Record()
        self._pending: list[float] = []
        if own_loss:
            model.register_forward_hook(self._own_loss_hook)
        for name, module in model.named_modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, nn.SyncBatchNorm):
                module.register_forward_pre_hook(self._batchnorm_hook(name))

    def _batchnorm_hook(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple) -> None:
            if name not in self.record.batchnorm_means and module.training:
                x = args[0].detach().float()
                self.record.batchnorm_means[name] = x.transpose(0, 1).reshape(x.shape[1], -1).mean(1).cpu()

        return hook

    def _own_loss_hook(self, module: nn.Module, args: tuple, out: object) -> None:
        """Note the loss the model returned in training (a pipeline's stages run copies of the model that share
        this hook: the last one returns the loss, the others hidden states; its shape pass is left out)."""
        if not module.training or not torch.is_grad_enabled() or inside(FORWARD_FRAMES, depth=24):
            return
        loss = find_loss(out)
        if loss is not None:
            self._pending.append(float(plain(loss).detach()))

    def wrap_loss(self, loss: Loss | None) -> Loss | None:
        """``loss`` that also notes its value (for the step the optimizer is in); None stays None (the model's own
        loss is noted by a hook)."""
        if loss is None:
            return None

        def recorded(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            value = loss(outputs, targets)
            if not inside(LOSS_FRAMES):  # pipelining's shape pass calls the loss on placeholders
                self._pending.append(float(value.detach()))
            return value

        return recorded

    def end_step(self, grad_norm: float, state: dict[str, torch.Tensor] | None) -> None:
        self.record.losses.append(self._pending)
        self._pending = []
        self.record.grad_norms.append(grad_norm)
        if state is not None:
            self.record.states.append(state)


class RecordingDataset(Dataset):
    """The user's dataset, noting the index of every sample fetched (in this process, so no loader workers)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset
        self.fetched: list[int] = []

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int):
        self.fetched.append(int(index))
        return self.dataset[index]


def recording_loader(loader: DataLoader) -> tuple[DataLoader, RecordingDataset]:
    """``loader`` over a :class:`RecordingDataset`: same sampler, batch size and collation, no worker processes."""
    dataset = RecordingDataset(loader.dataset)
    rebuilt = DataLoader(
        dataset,
        batch_size=loader.batch_size,
        sampler=loader.sampler,
        num_workers=0,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last,
        generator=loader.generator,
    )
    return rebuilt, dataset


class _Stop(Exception):
    """Raised by the optimizer hook once enough steps ran: ends the user's loop wherever it is."""


def run_loop(
    spec: VerifySpec,
    par: Parallel,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: DataLoader,
    recorder: RecordHooks,
    steps: int,
    *,
    keep_states: bool,
) -> None:
    """The user's loop (or :func:`~paratrain.verify.spec.paratrain_loop`) on the prepared ``model`` and
    ``optimizer`` until the optimizer has stepped ``steps`` times, recording the global gradient norm before each
    step and (with ``keep_states``) the full state after it. Collective in the parallel run: every rank calls it."""
    group = par.strategy.grad_norm_group(model)
    norms: list[float] = []

    def before_step(*_: object) -> None:
        # a tied weight that two pipeline stages hold counts once
        norms.append(float(global_grad_norm(par.strategy.grad_norm_parameters(model), group)))

    def after_step(*_: object) -> None:
        state = par.full_state_dict(model)  # collective; rank 0 keeps a copy (it may alias the live tensors)
        recorder.end_step(norms.pop(), {k: v.clone() for k, v in state.items()} if keep_states else None)
        if recorder.record.steps >= steps:
            raise _Stop

    optimizer.register_step_pre_hook(before_step)
    optimizer.register_step_post_hook(after_step)
    try:
        spec.loop(par, model, optimizer, loader, recorder.wrap_loss(spec.loss))
    except _Stop:
        pass
