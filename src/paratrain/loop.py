"""Where the training loop is and what ``par.step`` and ``par.epochs`` do at its boundaries: what one micro-step
is, the optimizer step at the end of an accumulation window, each epoch's sample order, and the counters a
checkpoint saves and a resume restores."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from .data import ShardedLoader, ShardSampler
from .distributed.grad_norm import clip_grads_with_norm, global_grad_norm
from .errors import ConfigError
from .guard import Guard
from .precision import Precision
from .strategies.base import Strategy


@dataclass(frozen=True)
class GlobalBatch:
    """The batch of one optimizer step, stated once (``Parallel(accumulate=GlobalBatch(256, micro=8))``): how many
    micro-batches each replica accumulates follows from the layout, which under ``auto`` (or tp, pipelines) is only
    known once ``prepare`` has seen the model."""

    size: int
    """Samples per optimizer step, over every data-parallel replica and micro-step."""
    micro: int | None = None
    """Samples one replica feeds each ``par.step`` (None: the batch size of the first loader ``prepare`` gets)."""

    @classmethod
    def of(cls, size: int | None, micro: int | None) -> GlobalBatch | None:
        """From the former ``global_batch`` and ``micro_batch`` keywords (None when no global batch is given)."""
        if size is None:
            if micro is not None:
                raise ConfigError(
                    f"micro_batch={micro} given without global_batch; give both (accumulate then "
                    "follows from the layout), or neither"
                )
            return None
        return cls(size, micro)

    def __post_init__(self) -> None:
        for name, value in (("size", self.size), ("micro", self.micro)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"GlobalBatch's {name} must be an integer >= 1, got {value!r}")

    def accumulate(self, replicas: int, micro: int | None) -> int:
        """Micro-steps per optimizer step over ``replicas`` data-parallel replicas; one line when they do not
        divide the global batch."""
        micro = self.micro if self.micro is not None else micro
        if micro is None:
            raise ConfigError(
                f"GlobalBatch({self.size}) needs micro= (what one replica feeds each par.step), or a "
                "DataLoader passed to prepare() whose batch size it is"
            )
        per_step = micro * replicas
        if self.size % per_step:
            fits = [m for m in range(1, micro + 1) if self.size % (m * replicas) == 0][-1:]
            hint = f" (micro={fits[0]} fits)" if fits else ""
            raise ConfigError(
                f"GlobalBatch({self.size}) does not divide into micro-batches of {micro} x {replicas} "
                f"data-parallel replica(s) = {per_step} per micro-step; choose a global batch that is "
                f"a multiple of {per_step}, or another micro{hint}"
            )
        return self.size // per_step


@dataclass(frozen=True)
class StepInfo:
    """What one ``Parallel.step`` micro-step is."""

    micro_step: int
    """Index inside the accumulation window, 0 … accumulate-1."""
    sync: bool
    """True on the last micro-step: gradients are communicated and the optimizer steps."""


def finish_step(
    strategy: Strategy,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    precision: Precision,
    max_norm: float | None,
    guard: Guard | None = None,
) -> torch.Tensor | None:
    """End an accumulation window: the strategy completes the gradients (a weight tied across pipeline stages,
    tensor parallelism's partial sums), the global norm over every shard is taken when clipping to ``max_norm`` or
    when the numerics ``guard`` reads it, the guard may skip the step, the gradients are clipped, the optimizer
    steps (through the grad scaler, inside the strategy's ``optimizer_stepping``) and the gradients are freed. Where
    only the step sees the whole gradient (parameter servers), the step clips it instead. Returns the norm before
    clipping, a 0-d tensor nobody waits for until it is read (None when not taken)."""
    strategy.sync_gradients(model)
    norm, in_step = None, False
    if max_norm is not None or guard is not None:
        precision.unscale(optimizer)
        in_step = max_norm is not None and strategy.server.clips_in_step(optimizer, max_norm)
        if not in_step:
            norm = global_grad_norm(strategy.grad_norm_parameters(model), strategy.grad_norm_group(model)).detach()
    if guard is not None and guard.skips(strategy, model, optimizer, None if precision.skips_overflow else norm):
        optimizer.zero_grad(set_to_none=True)
        return norm
    if norm is not None and max_norm is not None:
        clip_grads_with_norm(model.parameters(), max_norm, norm)
    with strategy.optimizer_stepping(optimizer):
        precision.step(optimizer)
    if in_step:
        stepped = strategy.server.stepped_grad_norm(optimizer)
        norm = None if stepped is None else torch.tensor(stepped)
    optimizer.zero_grad(set_to_none=True)
    return norm


def start_epoch(loaders: Iterable[object], epoch: int) -> None:
    """Give every prepared loader's sampler the epoch, so each epoch shuffles in another (agreed) order."""
    for loader in loaders:
        sampler = getattr(loader, "sampler", None)
        if isinstance(sampler, ShardSampler):
            sampler.set_epoch(epoch)


def idle_epoch_warning(epoch: int, accumulate: int) -> str:
    """The line for an epoch that took no optimizer step."""
    return (
        f"paratrain: warning: epoch {epoch} took no optimizer step (accumulate={accumulate}, batches this epoch "
        "fewer than that, or none); check the loader and accumulate"
    )


class Loop:
    """The loop's position: the micro-step inside the accumulation window, the optimizer steps taken, the epoch.

    ``Parallel``'s verbs advance it; it is kept apart from them so the façade holds no counting rules.
    """

    def __init__(
        self,
        accumulate: int,
        clip_grad_norm: float | None,
        batch: GlobalBatch | None = None,
        guard: Guard | None = None,
    ) -> None:
        if not isinstance(accumulate, int) or accumulate < 1:
            raise ConfigError(f"accumulate must be an integer >= 1, got {accumulate!r}")
        if batch is not None and accumulate != 1:
            raise ConfigError(
                f"accumulate={accumulate} given with global_batch={batch.size}; give one of them "
                "(with global_batch, accumulate follows from the layout)"
            )
        if clip_grad_norm is not None and clip_grad_norm <= 0:
            raise ConfigError(f"clip_grad_norm must be > 0, got {clip_grad_norm}")
        self.accumulate, self.clip_grad_norm = accumulate, clip_grad_norm
        self.batch = batch
        """The global batch still to turn into ``accumulate`` (None once done, or when not given)."""
        self.micro_step = 0
        self.optimizer_steps = 0
        self.epoch: int | None = None
        self.resume_epoch: int | None = None  # the epoch a load resumes inside, until epochs() starts it
        self.last_grad_norm: torch.Tensor | None = None
        self.guard = guard
        """The numerics guard (:mod:`paratrain.guard`), when on."""

    def epochs(
        self, n: int, start: int, loaders: Iterable[object], training: Callable[[], bool], warn: Callable[[str], None]
    ) -> Iterator[int]:
        """``range(start, n)``, or from the resumed epoch; each epoch reorders the loaders, and the first epoch that
        takes no optimizer step while ``training()`` is ``warn``-ed about (once per loop)."""
        resumed, self.resume_epoch = self.resume_epoch, None
        warned = False
        for epoch in range(resumed if resumed is not None else start, n):
            self.epoch = epoch
            start_epoch(loaders, epoch)
            steps = self.optimizer_steps
            yield epoch
            if training() and self.optimizer_steps == steps and epoch != resumed and not warned:
                warned = True  # accumulate more micro-steps than an epoch has batches, say
                warn(idle_epoch_warning(epoch, self.accumulate))
            self.epoch = epoch + 1

    def size_batch(self, replicas: int | None, micro: int | None = None) -> None:
        """Turn a stated global batch into ``accumulate`` once the data-parallel ``replicas`` (None: not known yet)
        and the micro-batch are known."""
        batch = self.batch
        if batch is None or replicas is None or (batch.micro is None and micro is None):
            return
        self.accumulate, self.batch = batch.accumulate(replicas, micro), None

    def saw_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss``, the current micro-step's, kept for the numerics guard when there is one."""
        return loss if self.guard is None else self.guard.saw(self.micro_step, loss)

    def next_step(self) -> StepInfo:
        """What the coming micro-step is."""
        if self.batch is not None:
            self.batch.accumulate(1, None)  # the micro-batch was never given: one line says so
            raise ConfigError(f"global_batch={self.batch.size} needs the layout: call prepare() before par.step")
        return StepInfo(micro_step=self.micro_step, sync=self.micro_step == self.accumulate - 1)

    def stepped(
        self,
        info: StepInfo,
        strategy: Strategy,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        precision: Precision,
    ) -> None:
        """After the user's block of micro-step ``info`` exited cleanly: the optimizer step when it ends a window."""
        self.micro_step = (self.micro_step + 1) % self.accumulate
        if info.sync:
            norm = finish_step(strategy, model, optimizer, precision, self.clip_grad_norm, self.guard)
            self.last_grad_norm = norm if norm is not None else self.last_grad_norm
            self.optimizer_steps += 1

    def continue_at(self, steps: int, loaders: list[object]) -> None:
        """Continue, without a checkpoint, at the place of a process that took ``steps`` optimizer steps: the epoch
        and batch those steps reach in the first prepared loader (every epoch as long as this one); nothing for 0."""
        sharded = [loader for loader in loaders if isinstance(loader, ShardedLoader)]
        if steps <= 0 or not sharded or len(sharded[0]) < self.accumulate:
            return
        loader = sharded[0]
        per_epoch = len(loader) // self.accumulate
        epoch, batches = divmod(steps, per_epoch)
        sampler = loader.sampler
        assert isinstance(sampler, ShardSampler)
        loader.load_state_dict(
            {
                "epoch": epoch,
                "batches": batches * self.accumulate,
                "finished": False,
                "generator": None,
                "batch_size": loader.batch_size,
                "replicas": sampler.num_replicas,
            },
            epoch,
        )
        self.resume_at(steps, epoch)

    def resume_at(self, step: int, epoch: int | None) -> None:
        """Continue from a checkpoint's position: ``epochs()`` restarts inside ``epoch``."""
        self.optimizer_steps, self.epoch, self.resume_epoch = step, epoch, epoch
