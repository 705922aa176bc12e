"""``Parallel``: the one object a training script holds.

It reads the launcher's environment, starts the process group, picks the device, and wraps the user's model,
optimizer and data loaders for the chosen strategy. Every piece of state lives on the object: two
``Parallel`` objects in one process (in tests, say) do not share anything by accident. The work itself lives in
the components it composes: the strategy, the precision, the loop (:mod:`paratrain.loop`), the checkpoints
(:mod:`paratrain.checkpoint.auto`), the monitor.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from . import strategies
from .call_watch import CallWatch, collective
from .checkpoint.auto import AutoCheckpoint
from .checkpoint.config import CheckpointConfig
from .data import ShardedLoader, prepare_loader
from .devices import select_device
from .distributed.mesh import build_mesh
from .distributed.metrics import gather_object, reduce_value
from .distributed.process_group import finish_group, start_process_group
from .env import ClusterEnv
from .errors import ConfigError
from .loop import StepInfo, finish_step, idle_epoch_warning, start_epoch
from .model.facts import ModelFacts
from .monitor import MonitorConfig, monitor_for, resolve
from .options import BlockTransforms
from .precision import Precision, create_precision
from .rank_agreement import check_ranks_agree
from .rank_log import rank_logger
from .seeding import rank_seed, seed_all, use_deterministic_kernels
from .strategies.base import Runtime, Strategy

__all__ = ["Parallel", "StepInfo"]


class Parallel:
    """Run a single-device training loop on every process of the job.

    Args:
        strategy: a registered name (``"ddp"``, ``"zero3"``, ``"auto"``…) or a ``Strategy`` instance.
        precision: ``"fp32"``, ``"bf16-mixed"``, ``"fp16-mixed"`` (CUDA) or ``"bf16-true"``.
        accumulate: micro-batches per optimizer step (gradient accumulation).
        clip_grad_norm: clip the global gradient norm to this value before each optimizer step (sharded
            strategies compute the norm over every shard).
        accelerator: ``"auto"`` (CUDA when available), ``"cpu"`` or ``"cuda"``.
        timeout_s: how long any collective waits for the other ranks before failing.
        seed: when given, ``seed_everything(seed)`` is called at construction.
        deterministic: use deterministic kernels (cuDNN, cuBLAS, torch's deterministic ops), so that two runs of the
            same job on a GPU end with bitwise equal parameters; slower on some models. CPU runs are already
            repeatable.
        checkpoint_dir: where ``save``/``load`` keep checkpoints by default, and automatic ones go.
        checkpoint_every: save a checkpoint automatically every this many optimizer steps.
        keep_checkpoints: how many of the newest checkpoints to keep (default 3).
        resume: True: resume from ``checkpoint_dir``'s latest checkpoint, if any, when ``epochs()`` starts;
            None (default): only when torchrun restarted the job after a failure; False: never. The four
            checkpoint options default to ``paratrain run --checkpoint-dir/--checkpoint-every/--resume``.
        env: where this process sits; read from the environment when omitted.
        monitor: watch step time, data wait, stragglers and memory across ranks (``par.monitor``) and print a
            summary table at ``close()``; ``False`` turns it off, a ``MonitorConfig`` tunes it.
        activation_checkpointing: recompute the model's repeated blocks in backward instead of keeping their
            activations: ``True`` for every block, ``k`` for every k-th (see :mod:`paratrain.model.transforms`).
        compile: ``torch.compile`` each repeated block (or the whole model without blocks) before the strategy
            wraps it; a dict is passed to ``torch.compile`` as options (see :mod:`paratrain.model.transforms`).
        wait_report_s: a collective that waits this long prints which ranks have not arrived and what each last
            called (default: a fifth of ``timeout_s``, at most 60 s); see :mod:`paratrain.call_watch`.
        **strategy_options: options of the named strategy (e.g. ``bucket_cap_mb`` for ddp).
    """

    def __init__(
        self,
        strategy: str | Strategy = "auto",
        *,
        precision: str = "fp32",
        accumulate: int = 1,
        clip_grad_norm: float | None = None,
        accelerator: str = "auto",
        timeout_s: float = 300.0,
        seed: int | None = None,
        deterministic: bool = False,
        checkpoint_dir: str | os.PathLike | None = None,
        checkpoint_every: int | None = None,
        keep_checkpoints: int | None = None,
        resume: bool | None = None,
        env: ClusterEnv | None = None,
        monitor: bool | MonitorConfig = True,
        activation_checkpointing: bool | int = False,
        compile: bool | dict[str, Any] = False,
        wait_report_s: float | None = None,
        **strategy_options: Any,
    ) -> None:
        if not isinstance(accumulate, int) or accumulate < 1:
            raise ConfigError(f"accumulate must be an integer >= 1, got {accumulate!r}")
        if timeout_s <= 0:
            raise ConfigError(f"timeout_s must be > 0, got {timeout_s}")
        if clip_grad_norm is not None and clip_grad_norm <= 0:
            raise ConfigError(f"clip_grad_norm must be > 0, got {clip_grad_norm}")
        self.accumulate, self.clip_grad_norm = accumulate, clip_grad_norm
        monitor_config = resolve(monitor)
        self.transforms = BlockTransforms.of(activation_checkpointing, compile)
        """Activation checkpointing and compilation of the model's blocks in ``prepare``."""
        if deterministic:
            use_deterministic_kernels()
        self.checkpoint_config = CheckpointConfig.resolve(dir=checkpoint_dir, every=checkpoint_every,
                                                          keep=keep_checkpoints, resume=resume)
        self.env = env if env is not None else ClusterEnv.from_environ()
        self.strategy = strategies.resolve(strategy, self.env, strategy_options)
        # "auto" with several processes chooses its layout (and only then builds the mesh) when prepare sees the model
        self._auto_pending = strategy == "auto" and self.env.world_size > 1 and not strategy_options
        self.strategy.validate(self.env)
        self.precision: Precision = create_precision(precision)
        self.last_grad_norm: float | None = None
        self.device = select_device(self.env.local_rank, accelerator)
        self.precision.validate(self.device)
        needs_group = self._auto_pending or self.strategy.uses_group(self.env)
        self._owns_group = start_process_group(self.env, self.device, timeout_s, needs_group)
        self._calls = CallWatch(self.rank, self.world_size, timeout_s=timeout_s, report_after_s=wait_report_s,
                                enabled=self._distributed and self.env.launched)
        if self._distributed:
            with self._calls.call("Parallel()"):
                check_ranks_agree(self._agreed_values(), self.rank, dist.get_world_size())
        uses_mesh = not self._auto_pending and self.strategy.uses_group(self.env) and self._distributed
        self.mesh = build_mesh(self.device, self.strategy.dims(self.env), self.env.world_size) if uses_mesh else None
        self._seed: int | None = None
        self._micro_step = 0
        self.optimizer_steps = 0
        """Optimizer steps taken (restored by ``load``)."""
        self.epoch: int | None = None
        """The epoch ``epochs()`` is in (its end value once it is done); None before it starts."""
        self._resume_epoch: int | None = None
        self._models: list[nn.Module] = []
        self._records: dict[int, ModelFacts] = {}  # id(prepared model) → what it held before wrapping
        self._optimizers: list[tuple[nn.Module, torch.optim.Optimizer]] = []
        self._schedulers: list[Any] = []
        self._loaders: list[DataLoader] = []
        self._checkpoints = AutoCheckpoint(self.checkpoint_config, say=self.print)
        self.logger = rank_logger(self.env)
        self.monitor = monitor_for(monitor_config, self)
        if seed is not None:
            self.seed_everything(seed)

    # ----------------------------------------------------------------- identity
    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def data_parallel_rank(self) -> int:
        """This rank's index among the replicas that read different data (the ranks of one pipeline share it)."""
        return self._data_parallel()[0]

    @property
    def data_parallel_size(self) -> int:
        """How many replicas read different data: the world size, divided by the pipeline depth if any."""
        return self._data_parallel()[1]

    def _data_parallel(self) -> tuple[int, int, dist.ProcessGroup | None]:
        """(rank, size, group) of the replicas that read different data; refused while ``auto`` has not chosen."""
        if self._auto_pending:
            from .strategies.auto import BEFORE_THE_MODEL

            raise ConfigError(BEFORE_THE_MODEL)
        return self.strategy.data_parallel(self._runtime()) if self._distributed else (0, 1, None)

    @property
    def is_main(self) -> bool:
        """True on global rank 0."""
        return self.env.rank == 0

    @property
    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def _agreed_values(self) -> dict[str, str]:
        """What every rank must have alike (checked once at construction)."""
        # The mesh, not the processes per node: torchrun lets nodes run different numbers of processes, and only a
        # layout built from them (hsdp's shard groups of one node) must then be the same everywhere.
        return {"strategy": "auto" if self._auto_pending else self.strategy.describe(),
                "precision": self.precision.name, "accumulate": str(self.accumulate),
                "mesh": "auto" if self._auto_pending else str(self.strategy.dims(self.env).mesh_shape())}

    def seed_everything(self, seed: int) -> None:
        """Seed every RNG identically on all ranks, so models built next initialise identically.

        After ``prepare`` has wrapped a model, each rank's global RNGs move to a stream of their own (derived
        from ``seed`` and the rank), so random augmentation differs across ranks; DataLoader workers get
        per-rank, per-worker seeds through the loader's generator.
        """
        self._seed = seed
        seed_all(seed)

    # ----------------------------------------------------------------- preparation
    def prepare(self, *objects: Any) -> Any:
        """Wrap models, optimizers and data loaders for the strategy; returns them in the same order.

        Pass each model before its optimizer. Loaders are sharded for training (``prepare_loader``'s
        defaults); use ``prepare_loader(loader, even=False)`` for evaluation. An LR scheduler built on a prepared
        optimizer may be passed too (``sched = par.prepare(CosineAnnealingLR(optimizer, …))``): checkpoints then
        save and restore it. Everything prepared is what ``save`` and ``load`` cover.
        """
        out: list[Any] = []
        model: nn.Module | None = None
        for i, obj in enumerate(objects):
            if isinstance(obj, nn.Module):
                after = next((o for o in objects[i + 1:] if isinstance(o, (nn.Module, torch.optim.Optimizer))), None)
                model = self.prepare_model(obj, optimizer=after if isinstance(after, torch.optim.Optimizer) else None)
                out.append(model)
            elif isinstance(obj, torch.optim.Optimizer):
                if model is None:
                    raise ConfigError("prepare() got an optimizer before any model; pass the model first")
                out.append(self._prepare_optimizer(model, obj))
            elif isinstance(obj, DataLoader):
                out.append(self.prepare_loader(obj))
            elif isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
                if not any(obj.optimizer is opt for _, opt in self._optimizers):
                    raise ConfigError("this LR scheduler is not built on an optimizer that prepare() returned; "
                                      "prepare the optimizer first, then build the scheduler on the returned one and "
                                      "pass it to prepare()")
                self._schedulers.append(obj)
                out.append(obj)
            else:
                raise ConfigError(f"prepare() takes nn.Module, torch.optim.Optimizer, DataLoader and LR scheduler "
                                  f"objects, got {type(obj).__name__}")
        return out[0] if len(out) == 1 else tuple(out)

    def prepare_model(self, model: nn.Module, *, optimizer: torch.optim.Optimizer | None = None) -> nn.Module:
        """Place and wrap one model for the strategy and the precision.

        ``par.device`` then names where the model's outputs land (the last stage for ``model_parallel``), so
        moving targets there is always right. ``optimizer`` (``prepare`` passes the one that follows the model) is
        only read by ``strategy="auto"``, to plan its states rather than assume AdamW's; it is not prepared here.
        """
        if self._auto_pending:  # choose the layout once for this model, agreed by every rank, then build its mesh
            from .strategies.auto import agree_on_strategy

            self.strategy = agree_on_strategy(model, optimizer, self.env, self.device, self.precision.name, self.print)
            self._auto_pending = False
            self.mesh = build_mesh(self.device, self.strategy.dims(self.env), self.env.world_size)
        facts = ModelFacts.of(model)  # before anything is wrapped: blocks, ties, names
        rt = self._runtime(facts)
        wrapped = self.strategy.wrap_model(model, rt)
        facts.check_ties(self.strategy.unwrap(wrapped), self.strategy.name)
        self._records[id(wrapped)] = facts
        self.precision.wrap_forward(wrapped, rt.device, autocast=not self.strategy.native_precision)
        self.device = self.strategy.output_device(rt)
        if self._seed is not None:  # model init is done: give each rank (each tp group) its own random stream
            seed_all(rank_seed(self._seed, self.strategy.rng_rank(rt) if self._distributed else self.rank))
        self._models.append(wrapped)
        return wrapped

    def _prepare_optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        record = self._records[id(model)]
        record.check_source(optimizer)
        wrapped = self.strategy.wrap_optimizer(optimizer, model, self._runtime(record))
        record.check_kept(optimizer, wrapped, self.strategy.unwrap(model), self.strategy.name)
        self._optimizers.append((model, wrapped))
        return wrapped

    def prepare_loader(self, loader: DataLoader, *, even: bool = True, shard: bool = True) -> DataLoader:
        """A per-rank copy of ``loader`` (see :mod:`paratrain.data` for what happens to the tail).

        Args:
            even: pad so every rank runs the same number of steps (training); ``False`` sees every sample exactly
                once with uneven shards (evaluation).
            shard: ``False`` keeps the loader as it is (it already reads a per-rank part of the data).
        """
        prepared = loader
        if shard:  # pipeline stages and tensor-parallel groups share their batches
            rank, size, _ = self._data_parallel() if self._distributed else (0, 1, None)
            prepared = prepare_loader(loader, rank=rank, size=size, seed=self.data_seed, even=even,
                                      required=self._distributed)
        if isinstance(prepared, ShardedLoader):
            prepared.before_fetch = self._flush_checkpoint
            self._loaders.append(prepared)
        return self.monitor.wrap_loader(prepared) if self.monitor is not None else prepared

    @property
    def data_seed(self) -> int:
        """The seed of the order in which prepared loaders shuffle: ``seed_everything``'s, else 0."""
        return self._seed if self._seed is not None else 0

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside the strategy's wrapper (for inspection; its tensors may be shards)."""
        return self.strategy.unwrap(model)

    @collective("par.full_state_dict")
    def full_state_dict(self, model: nn.Module, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The full, unsharded, unprefixed state dict on the CPU (collective: call on every rank).

        With ``rank0_only`` other ranks get ``{}``; loadable into the plain model with ``load_state_dict``.
        """
        return self.strategy.full_state_dict(model, rank0_only)

    def _runtime(self, facts: ModelFacts | None = None) -> Runtime:
        return Runtime(env=self.env, device=self.device, mesh=self.mesh, precision=self.precision, facts=facts,
                       transforms=self.transforms)

    # ----------------------------------------------------------------- the loop
    def epochs(self, n: int, start: int = 0) -> Iterator[int]:
        """Yield ``range(start, n)`` (0-based by default; ``n`` is where it stops, not a count), setting every
        prepared sampler's epoch so the order changes.

        It first resumes from the latest checkpoint when the job is set to (see ``resume``); after a load it
        starts at the checkpoint's epoch, whose prepared loaders then yield only the batches not yet trained.
        """
        self.resume()
        resumed, self._resume_epoch = self._resume_epoch, None  # the epoch a load resumes inside, if any
        warned = False
        for epoch in range(resumed if resumed is not None else start, n):
            self.epoch = epoch
            start_epoch(self._loaders, epoch)
            steps = self.optimizer_steps
            yield epoch
            if self._optimizers and self.optimizer_steps == steps and epoch != resumed and not warned:
                warned = True  # once per loop: accumulate more micro-steps than an epoch has batches, say
                if self.is_main:
                    print(idle_epoch_warning(epoch, self.accumulate), file=sys.stderr, flush=True)
            self.epoch = epoch + 1

    @contextmanager
    @collective("par.step")
    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[StepInfo]:
        """One micro-step. Backward inside it; on the last micro-step of the accumulation window the gradients
        are synchronised, the optimizer steps and the gradients are zeroed when the block exits cleanly."""
        self._flush_checkpoint()
        info = StepInfo(micro_step=self._micro_step, sync=self._micro_step == self.accumulate - 1)
        with (nullcontext() if info.sync else self.strategy.no_sync(model),
              nullcontext() if self.monitor is None else self.monitor.block(model, info.sync)):
            yield info
        self._micro_step = (self._micro_step + 1) % self.accumulate
        if info.sync:
            norm = finish_step(self.strategy, model, optimizer, self.precision, self.clip_grad_norm)
            self.last_grad_norm = norm if norm is not None else self.last_grad_norm
            self.optimizer_steps += 1
            self._checkpoints.stepped(self.optimizer_steps)
            if self.monitor is not None:
                self.monitor.stepped()

    def forward_backward(self, model: nn.Module, x: torch.Tensor, target: torch.Tensor,
                         loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``loss_fn(model(x), target)`` and its backward, for every strategy; returns the detached loss.

        The same as ``loss = loss_fn(model(x), target); par.backward(loss)``, except that pipeline strategies
        run it as a micro-batch schedule, and that under mixed precision ``loss_fn`` sees the output in the compute
        dtype and runs under autocast (its fp32 ops upcast what they read; see :mod:`paratrain.precision`). Every
        rank gets the loss (a pipeline's last stage shares it).
        """
        loss = self.strategy.forward_backward(model, x, target, loss_fn, 1.0 / self.accumulate)
        if loss is None:
            loss = self.precision.loss(model, x, target, loss_fn, self.device)
            self.backward(loss)
        return loss.detach()

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate ``loss``, divided by the accumulation count so accumulated gradients are a mean."""
        self.precision.backward(loss / self.accumulate if self.accumulate > 1 else loss)

    # ----------------------------------------------------------------- collectives for metrics
    @collective("par.sum")
    def sum(self, value: torch.Tensor | float) -> torch.Tensor | float:
        """Sum of ``value`` over the data-parallel replicas: a tensor keeps its dtype and device, an int comes back
        an int, any other number a float."""
        _, size, group = self._data_parallel()  # a pipeline's stages hold one replica's value
        return reduce_value(value, mean=False, size=size, group=group, device=self.device)

    @collective("par.mean")
    def mean(self, value: torch.Tensor | float) -> torch.Tensor | float:
        """Mean of ``value`` over the data-parallel replicas: always floating (a float, or float64 for an integer
        tensor)."""
        _, size, group = self._data_parallel()
        return reduce_value(value, mean=True, size=size, group=group, device=self.device)

    @collective("par.barrier")
    def barrier(self) -> None:
        """Wait for every rank that trains (bounded by the process-group timeout)."""
        if self._distributed:
            dist.barrier(group=self.strategy.training_group(self._runtime()))

    # ----------------------------------------------------------------- checkpoints
    @collective("par.save")
    def save(self, path: str | os.PathLike | None = None) -> Path:
        """Checkpoint everything an exact resume needs into ``path/step-<step>`` (collective; atomic).

        ``path`` defaults to ``checkpoint_dir``. Saved: every prepared model and optimizer (sharded strategies
        write one shard per rank), LR schedulers and the grad scaler passed through ``prepare``, the optimizer
        step, the epoch and each prepared loader's position in it, and every rank's RNG states. Call it between
        optimizer steps. Returns the checkpoint's folder.
        """
        return self._checkpoints.save(self._checkpoint_targets(), path, self._micro_step, self.accumulate)

    @collective("par.load")
    def load(self, path: str | os.PathLike | None = None) -> Path:
        """Restore everything ``save`` wrote (collective), from a ``step-…`` folder or a root's latest checkpoint.

        Call it after ``prepare`` (and after building the schedulers); the next ``epochs()`` continues from the
        saved epoch and position. Works at another world size or strategy: sharded state is resharded. Returns
        the checkpoint's folder.
        """
        position = self._checkpoints.load(self._checkpoint_targets(), path)
        if self._optimizers:  # weights alone (no optimizer prepared) do not move the loop
            self.optimizer_steps, self.epoch, self._resume_epoch = position.step, position.epoch, position.epoch
        return position.folder

    def resume(self) -> Path | None:
        """Load ``checkpoint_dir``'s latest checkpoint if the job is set to resume and one exists (once).

        ``epochs()`` calls it; call it yourself before a loop that does not use ``epochs()``.
        """
        found = self._checkpoints.to_resume()
        return self.load(found) if found is not None else None

    def _flush_checkpoint(self) -> None:
        self._checkpoints.flush(self.save, self.optimizer_steps)

    def _checkpoint_targets(self) -> Any:
        from .checkpoint.io import Targets

        self.strategy.check_checkpoint()
        return Targets(strategy=self.strategy, models=self._models, optimizers=self._optimizers,
                       schedulers=self._schedulers, loaders=self._loaders, precision=self.precision,
                       step=self.optimizer_steps, epoch=self.epoch, rank=self.rank, world_size=self.world_size,
                       barrier=self.barrier, gather=gather_object)

    # ----------------------------------------------------------------- output and teardown
    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on rank 0 only."""
        if self.is_main:
            kwargs.setdefault("flush", True)
            print(*args, **kwargs)

    @collective("par.close")
    def close(self) -> None:
        """Wait for every rank, then destroy the process group if this object created it (safely on gloo: see
        :func:`~paratrain.distributed.process_group.finish_group`)."""
        self._flush_checkpoint()
        if self.monitor is not None:
            self.monitor.close(self.print)  # the summary table (a small all-gather) while every peer is here
        self.strategy.close()
        if self._owns_group and dist.is_initialized():
            finish_group()
        self._owns_group = False
        self._calls.close()

    def __enter__(self) -> "Parallel":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
        # On an error the peers may be gone or stuck mid-collective: a barrier would only wait for the
        # timeout. The process is ending; the launcher stops the others.

    def __repr__(self) -> str:
        return (f"Parallel(strategy={self.strategy.describe()}, rank={self.rank}/{self.world_size}, "
                f"device={self.device}, precision={self.precision.name}, accumulate={self.accumulate})")
