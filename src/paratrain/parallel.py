"""``Parallel``: the one object a training script holds, a façade over the components that do the work.

Its verbs wrap the user's model, optimizer and loaders and run the loop; the work lives in what it composes: the
session (:mod:`paratrain.session`), the strategy (:mod:`paratrain.strategies.chosen`), the precision, what was
prepared (:mod:`paratrain.prepared`), the loop (:mod:`paratrain.loop`), the checkpoints, the monitor and the
trackers. All state lives on the object: two ``Parallel`` objects in one process share nothing by accident.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import DataLoader

from .batch import ModelCall
from .call_watch import collective
from .checkpoint.auto import AutoCheckpoint
from .checkpoint.config import CheckpointConfig
from .checkpoint.io import Targets
from .checkpoint.weights import load_weights
from .data import ShardedLoader, map_evenly, prepare_loader
from .distributed.metrics import gather_object, reduce_value
from .distributed.process_group import group_started
from .env import ClusterEnv
from .guard import Guard, GuardConfig
from .loop import GlobalBatch, Loop, StepInfo
from .loss import HeadLoss
from .model.facts import ModelFacts
from .model.materialize import Materializer, check_materialized
from .monitor import LogWith, MonitorConfig, TrackerConfig, Trackers, monitor_and_trackers, monitor_for
from .monitor.trackers import run_description
from .precision import Precision, create_precision
from .prepared import Prepared, prepare_each
from .rank_log import rank_logger
from .replicas import Replicas
from .script_verify import verified
from .seeding import seed_all, use_deterministic_kernels
from .session import Session
from .settings import JobConfig, ModelConfig, Settings
from .strategies.base import Runtime, Strategy
from .strategies.chosen import ChosenStrategy

__all__ = ["Parallel", "StepInfo"]


class Parallel:
    """Run a single-device training loop on every process of the job (docs/parallel.md has every verb and option).

    Args:
        strategy: a registered name (``"ddp"``, ``"zero3"``, ``"auto"``…) or a ``Strategy`` instance.
        accelerator: ``"auto"`` (CUDA where there is one), ``"cpu"`` or ``"cuda"``.
        precision: ``"fp32"``, ``"bf16-mixed"``, ``"fp16-mixed"`` (CUDA) or ``"bf16-true"``.
        accumulate: micro-batches per optimizer step, or ``GlobalBatch(size, micro=)``, the samples of one step,
            from which the count follows once the layout is known (:class:`paratrain.loop.GlobalBatch`).
        clip_grad_norm: clip the global gradient norm (over every shard) to this before each optimizer step.
        seed: ``seed_everything(seed)`` now.
        checkpoint: where ``save``/``load`` go and how often a job saves itself: a directory, or a
            ``CheckpointConfig(dir=, every=, keep=, resume=)`` (docs/checkpoints.md).
        log_with: trackers for ``par.log`` and the monitor's figures (rank 0): names, configs, ``TrackerConfig``.
        monitor: ``par.monitor`` (step time, data wait, stragglers, memory); ``False`` or a ``MonitorConfig``.
        guard: skip optimizer steps whose loss or gradient norm is not finite (or spikes): ``True``, a ``GuardConfig``.
        model: a ``ModelConfig``: activation checkpointing, compilation, meta init, chunked loss.
        job: a ``JobConfig``: collective timeout, where this process sits, deterministic kernels.
        **strategy_options: options of the named strategy (e.g. ``bucket_cap_mb`` for ddp, ``tp=2``).
    """

    @verified
    def __init__(
        self,
        strategy: str | Strategy = "auto",
        *,
        accelerator: str = "auto",
        precision: str = "fp32",
        accumulate: int | GlobalBatch = 1,
        clip_grad_norm: float | None = None,
        seed: int | None = None,
        checkpoint: CheckpointConfig | str | os.PathLike | None = None,
        log_with: TrackerConfig | LogWith | None = None,
        monitor: bool | MonitorConfig = True,
        guard: bool | GuardConfig = False,
        model: ModelConfig | None = None,
        job: JobConfig | None = None,
        **strategy_options: Any,
    ) -> None:
        settings = Settings.parse(
            accumulate=accumulate, model=model, job=job, checkpoint=checkpoint, options=strategy_options, guard=guard
        )
        self._loop = Loop(settings.accumulate, clip_grad_norm, settings.batch, Guard.of(settings.guard, self))
        watching, tracking = monitor_and_trackers(monitor, log_with)
        self._loss, self.init_fn = HeadLoss(settings.model.loss_chunk), settings.model.init_fn
        self.transforms = settings.model.transforms
        """Activation checkpointing and compilation of the model's blocks in ``prepare``."""
        if settings.job.deterministic:
            use_deterministic_kernels()
        self.checkpoint_config = settings.checkpoint
        self.env = settings.job.env if settings.job.env is not None else ClusterEnv.from_environ(joined=group_started())
        self._chosen = ChosenStrategy(strategy, self.env, settings.strategy_options, settings.moe_aux_loss)
        self.precision: Precision = create_precision(precision)
        self._session = Session(
            self.env,
            accelerator,
            self.precision,
            timeout_s=settings.job.timeout_s,
            wait_report_s=settings.job.wait_report_s,
            **self._chosen.placement(),
        )
        self.device, self._calls = self._session.device, self._session.calls
        self._calls.every_rank = not self.strategy.server.serves
        self._session.agree(
            {
                **self._chosen.agreed_values(),
                "precision": self.precision.name,
                "accumulate": str(self.accumulate),
                "global batch": str(self._loop.batch),
            }
        )
        self._chosen.build_mesh(self.device)
        self._prepared, self._seed = Prepared(), None  # the seed: seed_everything's (int | None)
        self._checkpoints = AutoCheckpoint(self.checkpoint_config, self.print, settings.job.timeout_s, self.env)
        self._size_batch()
        self._replicas = Replicas(self._session, self.world_size, self._chosen, self._runtime)
        self.logger = rank_logger(self.env)
        self.trackers = Trackers(
            tracking,
            active=self.is_main,
            describe=lambda: run_description(  # opened on rank 0
                self.strategy,
                world_size=self.world_size,
                data_parallel_size=self.data_parallel_size,
                precision=self.precision.name,
                accumulate=self.accumulate,
                device=self.device,
            ),
        )
        self.monitor = monitor_for(
            watching,
            self._runtime,
            trackers=self.trackers,
            accumulate=self.accumulate,
            group=self.strategy.server.training_group(self.env),
            emit=self.logger.warning,
            replicas=lambda: self.data_parallel_size,
        )
        if seed is not None:
            self.seed_everything(seed)

    rank = property(lambda self: self.env.rank, doc="This process's global rank.")
    local_rank = property(lambda self: self.env.local_rank, doc="Its rank on this node.")
    world_size = property(lambda self: self.env.world_size, doc="Processes in the job.")
    is_main = property(lambda self: self.env.rank == 0, doc="True on global rank 0.")
    accumulate = property(lambda self: self._loop.accumulate, doc="Micro-batches per optimizer step.")
    optimizer_steps = property(lambda self: self._loop.optimizer_steps, doc="Optimizer steps taken (restored by load).")
    epoch = property(lambda self: self._loop.epoch, doc="The epoch epochs() is in (its end once done); None before.")

    @property
    def strategy(self) -> Strategy:
        """The strategy running (``auto``'s choice once ``prepare`` has seen the model)."""
        return self._chosen.strategy

    @property
    def mesh(self) -> DeviceMesh | None:
        """The device mesh the strategy runs on (None in one process, and while ``auto`` waits for the model)."""
        return self._chosen.mesh

    last_grad_norm = property(lambda self: self._loop.last_grad_norm, doc="The last step's global gradient norm.")

    @property
    def data_parallel_rank(self) -> int:
        """This rank's index among the replicas that read different data (the ranks of one pipeline share it)."""
        return self._chosen.data_parallel(self._runtime())[0]

    @property
    def data_parallel_size(self) -> int:
        """How many replicas read different data: the world size, divided by the pipeline depth if any."""
        return self._chosen.data_parallel(self._runtime())[1]

    def seed_everything(self, seed: int) -> None:
        """Seed every RNG alike on all ranks, so models built next start equal; once ``prepare`` has wrapped a
        model each rank (each tp group) moves to a stream of its own, so random augmentation differs per rank."""
        self._seed = seed
        seed_all(seed)

    def prepare(self, *objects: Any) -> Any:
        """Wrap models (each before its optimizer), optimizers, loaders (sharded for training) and LR schedulers
        built on a prepared optimizer; returns them in the same order. ``save`` and ``load`` cover exactly these."""
        return prepare_each(
            objects,
            model=lambda m, opt, data: self.prepare_model(m, optimizer=opt, loader=data),
            optimizer=lambda m, opt: self._replicas.watch_optimizer(
                self._prepared.add_optimizer(self.strategy, m, opt, self._runtime), self.strategy
            ),
            loader=self.prepare_loader,
            scheduler=self._prepared.add_scheduler,
        )

    def prepare_model(
        self, model: nn.Module, *, optimizer: torch.optim.Optimizer | None = None, loader: DataLoader | None = None
    ) -> nn.Module:
        """Place and wrap one model; ``par.device`` then names where its outputs land (the last stage for
        ``model_parallel``). ``optimizer`` and ``loader`` (``prepare`` passes those given after the model) are only
        read by ``auto``, to plan the optimizer's states and the batch's activations; they are not prepared here."""
        self._chosen.decide(model, optimizer, loader, self.device, self.precision.name, self.print)  # auto: once
        self._size_batch()
        facts = ModelFacts.of(model)  # before anything is wrapped: blocks, ties, names
        rt = self._runtime(facts, self.strategy.materializer(model, self.device, self.init_fn))  # None unless on meta
        self._replicas.start(model, rt.materialize, self._seed, self.print)
        wrapped = self._chosen.wrap_model(model, rt)
        if rt.materialize is not None:  # nothing may be left on meta
            check_materialized(self.strategy.unwrap(wrapped), self.strategy.name)
        facts.check_ties(self.strategy.unwrap(wrapped), self.strategy.name)
        self.precision.wrap_forward(wrapped, rt.device)
        self._replicas.watch(wrapped, self.strategy)
        self.device = self.strategy.output_device(rt)
        self._replicas.streams(self._seed, self.strategy.rng_rank(rt), self.rank)
        return self._prepared.add_model(wrapped, facts)

    def _size_batch(self, micro: int | None = None) -> None:
        self._loop.size_batch(None if self._chosen.pending else self.data_parallel_size, micro)

    def prepare_loader(self, loader: DataLoader, *, even: bool = True, shard: bool = True) -> DataLoader:
        """A per-rank copy of ``loader`` (:mod:`paratrain.data`): ``even`` pads so every rank runs the same steps,
        ``even=False`` sees each sample once (evaluation), ``shard=False`` keeps a loader that reads its own part."""
        prepared = loader
        self._size_batch(loader.batch_size)
        if shard:  # pipeline stages and tensor-parallel groups share their batches
            rank, size, _ = self._chosen.data_parallel(self._runtime())  # (0, 1, None) without a process group
            prepared = prepare_loader(
                loader, rank=rank, size=size, seed=self.data_seed, even=even, required=self._session.distributed
            )
        if isinstance(prepared, ShardedLoader):
            prepared.before_fetch = self._flush_checkpoint
            self._prepared.add_loader(prepared)
        return self.monitor.wrap_loader(prepared) if self.monitor is not None else prepared

    @property
    def data_seed(self) -> int:
        """The seed of the order in which prepared loaders shuffle: ``seed_everything``'s, else 0."""
        return self._seed if self._seed is not None else 0

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside the strategy's wrapper (for inspection; its tensors may be shards)."""
        return self.strategy.unwrap(model)

    @collective("par.full_state_dict", meet="every rank must call it (rank 0 gets the state)")
    def full_state_dict(self, model: nn.Module, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The full, unsharded, unprefixed state dict on the CPU, for the plain model's ``load_state_dict``
        (collective); with ``rank0_only`` the other ranks get ``{}``."""
        return self.strategy.full_state_dict(model, rank0_only)

    def _runtime(self, facts: ModelFacts | None = None, materialize: Materializer | None = None) -> Runtime:
        return Runtime(
            env=self.env,
            device=self.device,
            mesh=self.mesh,
            precision=self.precision,
            facts=facts,
            transforms=self.transforms,
            materialize=materialize,
            checkpointing=self._checkpoints.on,
        )

    def epochs(self, n: int, start: int = 0) -> Iterator[int]:
        """``range(start, n)`` (``n`` is where it stops), reshuffling the prepared loaders each epoch. It first
        resumes when the job is set to; after a load it starts inside the saved epoch, at the batches not trained."""
        self.resume()
        warn = (lambda line: print(line, file=sys.stderr, flush=True)) if self.is_main else (lambda line: None)
        yield from self._loop.epochs(n, start, self._prepared.loaders, lambda: bool(self._prepared.optimizers), warn)

    @contextmanager
    @collective("par.step")
    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[StepInfo]:
        """One micro-step. Backward inside it; on the last micro-step of the accumulation window the gradients
        are synchronised, the optimizer steps and the gradients are zeroed when the block exits cleanly."""
        self._flush_checkpoint()
        info = self._loop.next_step()
        with (
            nullcontext() if info.sync else self.strategy.no_sync(model),
            nullcontext() if self.monitor is None else self.monitor.block(model, info.sync),
        ):
            yield info
        self._loop.stepped(info, self.strategy, model, optimizer, self.precision)
        if info.sync:
            self._checkpoints.stepped(self.optimizer_steps, lambda: self.strategy.server.training_group(self.env))
            if self.monitor is not None:
                self.monitor.stepped(self.optimizer_steps)

    def forward_backward(
        self,
        model: nn.Module,
        x: Any,
        target: Any = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """One micro-batch's forward and backward, for every strategy; the detached loss on every rank, float32 under
        any precision: ``loss_fn(model(x, **kwargs), target)``, or without ``loss_fn`` the loss the model computes
        itself from ``model(x, target, **kwargs)`` (:mod:`paratrain.batch` says how it is called and read)."""
        call = self.strategy.batch(self._chosen.pack(self._runtime(), model, ModelCall.of(x, target, loss_fn, kwargs)))
        self._replicas.first_batch(call.first_tensor())
        loss = None if self._loss.on else self.strategy.forward_backward(model, call, 1.0 / self.accumulate)
        if loss is None:
            loss = self._loss(model, call, self.strategy, self.precision, self.device)
            self.backward(loss)
        return self._loop.saw_loss(loss.detach().float())

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate ``loss``, divided by the accumulation count so accumulated gradients are a mean."""
        self._prepared.check_graph(self._loop.saw_loss(loss), self.strategy.name)  # the numerics guard reads it
        self.precision.backward(loss / self.accumulate if self.accumulate > 1 else loss)

    @collective("par.sum")
    def sum(self, value: torch.Tensor | float) -> torch.Tensor | float:
        """Sum of ``value`` over the data-parallel replicas: a tensor keeps its dtype and device, an int comes back
        an int, any other number a float."""
        return self._reduce(value, mean=False)

    @collective("par.mean")
    def mean(self, value: torch.Tensor | float) -> torch.Tensor | float:
        """Mean of ``value`` over the data-parallel replicas: always floating (a float, or float64 for an integer
        tensor)."""
        return self._reduce(value, mean=True)

    def _reduce(self, value: torch.Tensor | float, mean: bool) -> torch.Tensor | float:
        size, group = self._chosen.metrics(self._runtime())  # a pipeline's stages hold one replica's value
        return reduce_value(value, mean=mean, size=size, group=group, device=self.device)

    @collective("par.map_evenly")
    def map_evenly(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
        """``[fn(item) for item in items]``, ``fn`` run as often on every rank (:func:`paratrain.data.map_evenly`)."""
        return map_evenly(fn, items, group=self.strategy.server.training_group(self.env), device=self.device)

    @collective("par.barrier")
    def barrier(self) -> None:
        """Wait for every rank that trains (bounded by the process-group timeout)."""
        if self._session.distributed:
            dist.barrier(group=self.strategy.server.training_group(self.env))

    @collective("par.save", meet="every rank must call it (each writes its part, once)")
    def save(self, path: str | os.PathLike | None = None, *, async_save: bool = False) -> Path:
        """Checkpoint what an exact resume needs (everything prepared, the step, epoch, loader positions, RNG
        states) into ``path/step-<step>``, atomically (collective; between optimizer steps); returns that folder.
        ``async_save``: written in the background, the folder appears once complete (:mod:`.checkpoint.background`)."""
        return self._checkpoints.save(
            self._checkpoint_targets(), path, self._loop.micro_step, self.accumulate, async_save
        )

    @collective("par.load", meet="every rank must call it (each reads its part)")
    def load(self, path: str | os.PathLike | None = None) -> Path:
        """Restore what ``save`` wrote, from a ``step-…`` folder or a root's latest (collective; after ``prepare``),
        resharded for another world size or strategy; ``epochs()`` then continues from there. Returns the folder."""
        position = self._checkpoints.load(self._checkpoint_targets(), path)
        if self._prepared.optimizers:  # weights alone (no optimizer prepared) do not move the loop
            self._loop.resume_at(position.step, position.epoch)
        return position.folder

    @collective("par.load_weights")
    def load_weights(self, model: nn.Module, path: str | os.PathLike) -> dict[str, Any]:
        """Read pretrained weights (safetensors, torch state dict) into a prepared ``model``, each rank its part."""
        self._checkpoints.wait_staged()  # a background save copies the weights these replace
        return load_weights(self.strategy.unwrap(model), path, self._prepared.facts.get(id(model)))

    def resume(self) -> Path | None:
        """Load the checkpoint directory's latest checkpoint once, if the job is set to resume and one exists
        (``epochs()`` calls it; call it before a loop without ``epochs()``)."""
        if (found := self._checkpoints.to_resume()) is None:  # a rank back after its process died: where it stood
            self._loop.continue_at(self.strategy.server.steps_taken(), self._prepared.loaders)
        return self.load(found) if found is not None else None

    def _flush_checkpoint(self) -> None:
        self._checkpoints.flush(self.save, self.optimizer_steps)

    def _checkpoint_targets(self) -> Targets:
        return self._prepared.targets(
            self.strategy,
            self.precision,
            step=self.optimizer_steps,
            epoch=self.epoch,
            rank=self.rank,
            world_size=self.world_size,
            barrier=self.barrier,
            gather=gather_object,
        )

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Numbers to the trackers at ``step`` (default: optimizer steps taken); rank 0 writes (docs/trackers.md)."""
        self.trackers.log(metrics, self.optimizer_steps if step is None else step)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on rank 0 only."""
        if self.is_main:
            print(*args, **{"flush": True, **kwargs})

    @collective("par.close")
    def close(self) -> None:
        """Flush a due checkpoint, wait for one being written, print the monitor's table, end trackers and our group."""
        self._checkpoints.flush(self.save, self.optimizer_steps, finishing=True)  # a stop agreed now: merely due
        self._checkpoints.close(self.barrier)
        if self.monitor is not None:
            self.monitor.close(self.print)  # the summary table (a small all-gather) while every peer is here
        self.trackers.close()
        self._session.close(meet=self.strategy.server.close())

    def __enter__(self) -> Parallel:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:  # preempted (saved, to resume), or the peers may be gone or stuck mid-collective: this rank's runs failed
            self.trackers.close(ok=self._checkpoints.preempted)

    def __repr__(self) -> str:
        return (
            f"Parallel(strategy={self.strategy.describe()}, rank={self.rank}/{self.world_size}, "
            f"device={self.device}, precision={self.precision.name}, accumulate={self.accumulate})"
        )
