"""Evidence a verify run gathers as it trains, the same way in the parallel run and in the reference.

Per optimizer step: the loss of every micro-batch (read from the loss function, or from what the model returns
when it computes its own), the global gradient norm before the step (before clipping), the full state after it, and
what each micro-step fed the model: the tensors of the prepared model's forward arguments and of the targets given
to the spec's loss, in order (the reference replays them when the loop reads from anything but the spec's loader).
Once: the channel means each non-synchronised BatchNorm saw at its first call. And which samples the loader handed
out, through a dataset wrapper that notes every index fetched. Both runs train through the user's loop with a
``Parallel``; :func:`run_loop` hooks the optimizer and stops the loop after K steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.data import DataLoader, Dataset

from ..batch import find_loss
from ..digest import state_digest
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
    inputs: list[list[Feed]] = field(default_factory=list)
    """Per optimizer step: the tensors of each training call of the prepared model (forward args and kwargs)."""
    targets: list[list[Feed]] = field(default_factory=list)
    """Per optimizer step: the tensors of the targets of each call of the spec's loss."""
    first_call: tuple[tuple, dict] | None = None
    """The first training call's ``(args, kwargs)`` (on the CPU), and the targets of the first loss call: the shape
    in which the reference hands the model and the loss the first step's global batch outside the loop."""
    first_targets: Any = None
    global_first: tuple[float, float] | None = None
    """The reference's, when it replayed: (loss, gradient norm) of one backward of the spec's loss on the first
    step's global batch at the initial weights, outside the loop: the scale the parallel run's first step must have,
    whatever the loop divides by."""
    window: int = 1
    """The reference's: micro-batches of the parallel run it takes as one batch (see verify/reference.py)."""
    replayed: bool = False
    """The reference's: it trained on the batches the parallel run recorded, not on its loader's samples."""
    error: str | None = None
    """The reference's: why it could not train as the parallel run did (one line)."""

    @property
    def steps(self) -> int:
        return len(self.grad_norms)


Feed = list[torch.Tensor]
"""The tensors of one call's arguments, in the order ``tree_flatten`` lists them (on the CPU)."""


def tensors_of(tree: Any) -> Feed:
    """The tensors in ``tree`` (args, kwargs, targets), detached copies on the CPU, in flattening order."""
    return [t.detach().cpu().clone() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _on_cpu(leaf: Any) -> Any:
    return leaf.detach().cpu().clone() if isinstance(leaf, torch.Tensor) else leaf


def feed_digest(feed: Feed) -> str:
    """SHA-256 of a call's tensors (their dtypes, shapes and bytes): equal digests, equal batches."""
    return state_digest({f"{i:04d}": t for i, t in enumerate(feed)})


class RecordHooks:
    """Fills a :class:`Record` from hooks on the user's model and a wrapper around the loss (``own_loss``: a hook
    reading the loss the model returns)."""

    def __init__(self, model: nn.Module, *, own_loss: bool = False) -> None:
        self.record = Record()
        self._pending: list[float] = []
        self._inputs: list[Feed] = []
        self._targets: list[Feed] = []
        self.recording: Callable[[], bool] = lambda: True
        """Whether a training call now is one of a step's (a script's own evaluation forwards are not)."""
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
        if not self.recording():
            return
        loss = find_loss(out)
        if loss is not None:
            self._pending.append(float(plain(loss).detach()))

    def watch_inputs(self, prepared: nn.Module) -> None:
        """Note what every training call of the ``prepared`` model gets, before any hook of the strategy's."""
        prepared.register_forward_pre_hook(self._input_hook, prepend=True, with_kwargs=True)

    def _input_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if training_call(module) and self.recording():
            self._inputs.append(tensors_of((args, kwargs)))
            if self.record.first_call is None:
                self.record.first_call = tree_map(_on_cpu, (args, kwargs))

    def wrap_loss(self, loss: Loss | None) -> Loss | None:
        """``loss`` that also notes its value and its targets (for the step the optimizer is in); None stays None
        (the model's own loss is noted by a hook)."""
        if loss is None:
            return None

        def recorded(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            value = loss(outputs, targets)
            if not inside(LOSS_FRAMES):  # pipelining's shape pass calls the loss on placeholders
                self._pending.append(float(value.detach()))
                if torch.is_grad_enabled():
                    self._targets.append(tensors_of(targets))
                    if self.record.first_targets is None:
                        self.record.first_targets = tree_map(_on_cpu, targets)
            return value

        return recorded

    def end_step(self, grad_norm: float, state: dict[str, torch.Tensor] | None) -> None:
        self.record.losses.append(self._pending)
        self.record.inputs.append(self._inputs)
        self.record.targets.append(self._targets)
        self._pending, self._inputs, self._targets = [], [], []
        self.record.grad_norms.append(grad_norm)
        if state is not None:
            self.record.states.append(state)


def training_call(module: nn.Module) -> bool:
    """A forward of a training step: in training mode, with gradients, not a pipeline's shape pass."""
    return module.training and torch.is_grad_enabled() and not inside(FORWARD_FRAMES, depth=24)


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
    loader: DataLoader | None,
    recorder: RecordHooks,
    steps: Callable[[], int],
    *,
    keep_states: bool,
    replay: Replay | None = None,
) -> None:
    """The user's loop (or :func:`~paratrain.verify.spec.paratrain_loop`) on the prepared ``model`` and
    ``optimizer`` until the optimizer has stepped ``steps()`` times, recording the global gradient norm before each
    step (before clipping) and (with ``keep_states``) the full state after it. ``replay``: feed the model and the
    loss the recorded batches instead of the loop's. Collective in the parallel run: every rank calls it."""
    watch_steps(par, model, optimizer, recorder, steps, keep_states=keep_states, done=_stop)
    loss = recorder.wrap_loss(spec.loss)
    if replay is not None:
        replay.attach(model, recorder.record)
        loss = replay.wrap_loss(loss)
    recorder.watch_inputs(model)
    try:
        spec.loop(par, model, optimizer, loader, loss)
    except _Stop:
        pass


def _stop() -> None:
    raise _Stop


def watch_steps(
    par: Parallel,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    recorder: RecordHooks,
    steps: Callable[[], int],
    *,
    keep_states: bool,
    done: Callable[[], None],
) -> None:
    """Hook the prepared ``optimizer``: record the global gradient norm before each step (before clipping) and
    (with ``keep_states``) the full state after it; call ``done`` once ``steps()`` steps are recorded."""
    group = par.strategy.grad_norm_group(model)
    norms: list[float] = []

    def norm() -> float:  # a tied weight that two pipeline stages hold counts once
        return float(global_grad_norm(par.strategy.grad_norm_parameters(model), group))

    def before_step(*_: object) -> None:
        if not norms:  # not clipped (clipping takes it first)
            norms.append(norm())

    def after_step(*_: object) -> None:
        state = par.full_state_dict(model)  # collective; rank 0 keeps a copy (it may alias the live tensors)
        recorder.end_step(norms[-1], {k: v.clone() for k, v in state.items()} if keep_states else None)
        norms.clear()
        if recorder.record.steps >= steps():
            done()

    _before_clipping(par, lambda: norms.append(norm()))
    optimizer.register_step_pre_hook(before_step)
    optimizer.register_step_post_hook(after_step)


def _before_clipping(par: Parallel, note: Callable[[], None]) -> None:
    """Call ``note`` where ``par`` clips, just before: the gradients are whole and unscaled there (a step's
    pre-hook comes after the clipping). The clip starts by unscaling the gradients, so that call is wrapped."""
    unscale = par.precision.unscale

    def unscaled(optimizer: torch.optim.Optimizer) -> None:
        unscale(optimizer)
        note()

    par.precision.unscale = unscaled  # type: ignore[method-assign]


class Replay(Protocol):
    """What :func:`run_loop` needs of the reference's replay (:class:`paratrain.verify.reference.Replay`)."""

    def attach(self, model: nn.Module, record: Record) -> None: ...

    def wrap_loss(self, loss: Loss | None) -> Loss | None: ...
