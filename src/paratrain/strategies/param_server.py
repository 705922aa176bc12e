"""``ps``: parameter-server training. The last ``servers`` ranks hold the parameters and their optimizer; the other
ranks train, pulling parameters and pushing gradients (:mod:`paratrain.distributed.param_server`).

``Parallel("ps", servers=1, staleness=0)``: synchronous by default (every step equals one process on the global
batch); ``staleness=tau`` applies each push as it arrives unless it was computed on parameters more than tau updates
old, so a slow worker holds no one back. A server rank serves from inside ``prepare`` (model, then optimizer) and
ends its process when every worker has closed; the code after ``prepare`` runs on the workers only.

Asynchronous workers are independent of each other, so one may die while the others train on: each worker tells
``paratrain run`` that it may leave (:mod:`paratrain.launcher.leaving`), shares no collective with the other workers
(``par.mean``/``par.sum`` are its own values, ``par.barrier`` waits for no one), and the servers notice the death
and learn from the launcher whether a new process takes its place; that process meets the servers in a group of
its own, pulls the current parameters and continues at the step its rank had reached. A job that checkpoints keeps
every worker to the end instead (a checkpoint is a collective of the workers): there a death stops the job, and a
restart resumes from the last checkpoint, as in synchronous mode.
"""

from __future__ import annotations

import functools
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint.single import read_alone, start_write_alone, write_alone
from ..dims import ParallelDims
from ..distributed.param_server.async_serving import Returns
from ..distributed.param_server.config import PSConfig
from ..distributed.param_server.holdings import Holdings, plan_holdings
from ..distributed.param_server.messages import LOAD, SAVE, SAVED, ProtocolError
from ..distributed.param_server.peers import Peer, return_group
from ..distributed.param_server.roles import WorkerSide, report, serve, shard_folder
from ..distributed.param_server.snapshot import ShardStore
from ..distributed.param_server.worker import PushingOptimizer
from ..distributed.process_group import finish_group
from ..env import ClusterEnv
from ..errors import CheckpointError, ConfigError
from ..launcher.leaving import BACK, allow_leaving, notice_key, notice_store, rejoin_count
from ..launcher.pg_timeout import DEFAULT_PG_TIMEOUT_S, PG_TIMEOUT_VAR
from .base import Runtime, Strategy
from .registry import register
from .serving import NoServer


@register("ps")
class ParameterServer(Strategy):
    name = "ps"
    host_tensors = True  # type: ignore[assignment]  # its messages: shards held on a server's host
    server: ServerRole

    def __init__(self, config: PSConfig | None = None, **options: Any) -> None:
        if config is not None and options:
            raise ConfigError(f"strategy 'ps' got options {sorted(options)} beside a PSConfig; set them on it")
        self.config = config if config is not None else PSConfig(**options)
        self.server = ServerRole(self.config)
        self._model: nn.Module | None = None
        self._layout: Holdings | None = None

    def validate(self, env: ClusterEnv) -> None:
        self.config.check_world(env.world_size)
        self.server.env = env

    def dims(self, env: ClusterEnv) -> ParallelDims:
        return ParallelDims(dp_replicate=env.world_size)

    def materializer(self, model: nn.Module, device: torch.device, init_fn: Any) -> None:
        """None: a table built on the meta device is allocated row-shard by row-shard on the servers, and a worker
        keeps its copy on meta (it pulls the rows its batch reads)."""
        if init_fn is not None:
            raise ConfigError("strategy 'ps' initializes a meta-built table on its servers; drop init_fn")
        return None

    def wrap_model(self, model: nn.Module, rt: Runtime) -> nn.Module:
        if self.server.worker is not None or self._model is not None:
            raise ConfigError("strategy 'ps' prepares one model per Parallel object")
        if dist.is_initialized() and "gloo" not in str(dist.get_backend()):
            raise ConfigError(
                f"ps sends its messages as host tensors received from any worker, which the "
                f"{dist.get_backend()} backend cannot; let Parallel start the group, or start it with "
                "backend='cpu:gloo,cuda:nccl'"
            )
        layout = plan_holdings(model, rt.env.world_size, self.config)
        if self.server.is_server(rt.env):
            self._layout, self._model = layout, model  # served once the optimizer is known
            return model
        peers = self._return_peers(rt.env) if self.server.joins_alone(rt.env) else None
        self.server.worker = WorkerSide(model, layout, rt.env.rank, self.config, rt.device, peers)
        return model

    def _return_peers(self, env: ClusterEnv) -> list[Peer]:
        """The servers, in the group a returning worker makes with them (they wait for it: the launcher told them
        it comes back)."""
        store = notice_store(_timeout())
        if store is None:
            raise ConfigError(
                "a returning parameter-server worker needs paratrain run's notice store "
                "(PARATRAIN_NOTICE_STORE); launch the job with paratrain run"
            )
        group = return_group(store, env.rank, rejoin_count(), 0, self.config.servers, _timeout())
        return [Peer(group, 1 + i) for i in range(self.config.servers)]

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module, rt: Runtime) -> torch.optim.Optimizer:
        if self.server.worker is not None:
            pushing = self.server.worker.optimizer(optimizer, model)
            if not self.config.synchronous and not rt.checkpointing:
                self.server.may_leave = True  # once it has trained: a failure before (a bug, bad input) stops the job
                pushing.after_first_push = functools.partial(allow_leaving, rt.env.rank)
            return pushing
        assert self._model is not None and self._layout is not None
        model, self._model = self._model, None
        returns = None if self.config.synchronous else _returns()
        store = ShardStore(write_alone, read_alone, start_write_alone)
        serve(model, optimizer, self._layout, rt.env.rank, self.config, store, returns)
        # synchronous: meets the workers' Parallel.close, which waits for every rank before the group goes
        finish_group(meet=self.config.synchronous)
        raise SystemExit(0)  # training is over: the workers' results are the job's

    def data_parallel(self, rt: Runtime) -> tuple[int, int, dist.ProcessGroup | None]:
        workers = rt.env.world_size - self.config.servers
        if self.server.is_server(rt.env):
            return 0, 1, None  # a server reads no data
        return rt.env.rank, workers, self.server.training_group(rt.env)

    def metrics(self, rt: Runtime) -> tuple[int, dist.ProcessGroup | None]:
        """An asynchronous worker's ``par.mean``/``par.sum`` are its own values (its peers may have left)."""
        return super().metrics(rt) if self.config.synchronous else (1, None)

    def full_state_dict(self, model: nn.Module, rank0_only: bool) -> dict[str, torch.Tensor]:
        worker = self.server.worker
        if worker is None:
            return {}
        return worker.full_state(model) if not rank0_only or worker.client.rank == 0 else {}

    def optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """A worker's optimizer holds no state (the servers' does): its param groups' settings, by group (an LR
        schedule on the workers sets them). Never stepped to make state, as other optimizers are: a step pushes."""
        return {f"group{i}.{k}": v for i, g in enumerate(optimizer.param_groups) for k, v in g.items() if k != "params"}

    def load_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        for i, g in enumerate(optimizer.param_groups):
            g.update({k: state[f"group{i}.{k}"] for k in g if k != "params"})

    def traffic_bytes(self, model: nn.Module, steps: int) -> int | None:
        """Measured on a worker: the payload bytes of every message it sent (gradients, row ids) and of every answer
        it received (parameters, rows) since ``prepare``, its first pull included; a server counts nothing."""
        if self.server.worker is None:
            return None
        stats = self.server.worker.client.stats
        return stats.push_bytes + stats.pull_bytes

    def describe(self) -> str:
        c = self.config
        return f"ps(servers={c.servers}, {'sync' if c.synchronous else f'staleness={c.staleness}'})"


class ServerRole(NoServer):
    """The last ``servers`` ranks serve, the others train as workers: which rank is which, the groups the workers
    train and checkpoint in, a worker's side of the protocol (``worker``, set when it prepares its model), and how
    each side ends."""

    serves = True

    def __init__(self, config: PSConfig) -> None:
        self.config = config
        self.worker: WorkerSide | None = None
        self.env: ClusterEnv | None = None
        """The job's ranks, known once the strategy is validated."""
        self.may_leave = False
        """An asynchronous worker of a job that does not checkpoint: it may leave once it has trained."""
        self._group: dist.ProcessGroup | None = None  # every worker
        self._own: dist.ProcessGroup | None = None  # an asynchronous worker alone
        self._closed = False

    def is_server(self, env: ClusterEnv) -> bool:
        return env.rank >= env.world_size - self.config.servers

    def on_host(self, env: ClusterEnv) -> bool:
        return self.is_server(env)

    def joins_alone(self, env: ClusterEnv) -> bool:
        """An asynchronous worker that takes the place of one that died: it meets the servers in a group of its
        own (made in the strategy's ``wrap_model``)."""
        return not self.config.synchronous and not self.is_server(env) and rejoin_count() > 0

    def training_group(self, env: ClusterEnv) -> dist.ProcessGroup | None:
        """The workers' group; an asynchronous worker's monitor and ``par.barrier`` take part in no one else's (a
        group of itself alone: its peers may have left, or be far behind)."""
        if self.config.synchronous or self.is_server(env) or not dist.is_initialized() or self.joins_alone(env):
            return self._workers(env)  # None on a server, and on a returning worker (its own group holds it alone)
        if self._own is None:
            self._own = dist.new_group([env.rank], use_local_synchronization=True)
        return self._own

    def steps_taken(self) -> int:
        """The pushes the servers took from this worker's rank before this process (one that came back) pulled;
        told once."""
        if self.worker is None or self.env is None or not self.joins_alone(self.env):
            return 0
        steps, self.worker.client.steps_before = self.worker.client.steps_before, 0
        return steps

    def _workers(self, env: ClusterEnv | None) -> dist.ProcessGroup | None:
        """The workers' own group (made by the workers alone: the servers are serving); None on a server."""
        if env is None or self.is_server(env) or not dist.is_initialized() or self.joins_alone(env):
            return None
        if self._group is None:
            workers = list(range(env.world_size - self.config.servers))
            self._group = dist.new_group(workers, use_local_synchronization=True)
        return self._group

    def clips_in_step(self, optimizer: torch.optim.Optimizer, max_norm: float) -> bool:
        """A worker's step clips: synchronous servers clip the mean gradient of the step over every server (as one
        process on the global batch), an asynchronous worker its own gradient, rows included, before its push."""
        if not isinstance(optimizer, PushingOptimizer):
            return False
        optimizer.max_norm = max_norm
        return True

    def stepped_grad_norm(self, optimizer: torch.optim.Optimizer) -> float | None:
        return optimizer.grad_norm if isinstance(optimizer, PushingOptimizer) else None

    def traffic_seconds(self) -> float | None:
        """A worker's time in its pulls and pushes (waiting for the answers included); a server times nothing."""
        return None if self.worker is None else self.worker.client.stats.pull_s + self.worker.client.stats.push_s

    # ----------------------------------------------------------------- checkpoints
    def checkpoint_group(self) -> dist.ProcessGroup | None:
        """The workers save and load together; the servers, serving, take part through their messages."""
        if self.may_leave or (self.env is not None and self.joins_alone(self.env)):
            raise ConfigError(
                "asynchronous ps workers may leave the job, so they cannot save or load together; set "
                "a checkpoint directory (Parallel(checkpoint=DIR) or paratrain run --checkpoint-dir) to "
                "checkpoint an asynchronous job: its workers then stay to the end"
            )
        return self._workers(self.env)

    def save_shards(self, folder: Path, rank: int, background: bool = False) -> None:
        """Rank 0 has every server write its shard into ``folder/server-NNN`` (the workers are all between steps:
        they are inside ``save``), and waits for them; ``background``: for them to have staged it."""
        if self.worker is not None and rank == 0:
            self._servers_do(folder, SAVE, background)

    def shards_written(self, folder: Path, rank: int) -> None:
        """Rank 0 waits for every server's background write into ``folder``."""
        if self.worker is not None and rank == 0:
            self._servers_do(folder, SAVED)

    def load_shards(self, folder: Path, rank: int) -> None:
        """Rank 0 has every server read its shard back; then every worker pulls the restored parameters. A server's
        refusal is raised on rank 0 after the barrier the others wait in (the caller makes every rank fail alike)."""
        if self.worker is None:
            return
        refused = None
        if rank == 0:
            try:
                self._servers_do(folder, LOAD)
            except CheckpointError as err:
                refused = err
        dist.barrier(group=self._workers(self.env))  # every server has answered before anyone pulls
        if refused is not None:
            raise refused
        self.worker.client.pull_dense()

    def check_shards(self, folder: Path) -> None:
        saved = len([p for p in folder.iterdir() if p.is_dir() and p.name.startswith("server-")])
        if saved != self.config.servers or any(not Path(f).is_dir() for f in self._shard_folders(folder)):
            raise CheckpointError(
                f"checkpoint {folder} holds the shards of {saved} parameter server(s), this job has "
                f"{self.config.servers}; load it with servers={saved} (shards are cut per server)"
            )

    def _servers_do(self, folder: Path, kind: int, background: bool = False) -> None:
        try:
            self.worker.client.checkpoint(self._shard_folders(folder), kind, background)
        except ProtocolError as err:
            raise CheckpointError(
                f"a parameter server could not {'read' if kind == LOAD else 'write'} its shard: {err}"
            ) from None

    def _shard_folders(self, folder: Path) -> list[str]:
        return [str((folder / shard_folder(i)).absolute()) for i in range(self.config.servers)]

    def close(self) -> bool:
        """On a worker: tell the servers it is done, then the table of pulls, pushes and the servers' load (rank 0
        prints it; asynchronous: the first server, as every worker's goodbye reaches it). Asynchronous workers do
        not meet at the end: some may have left."""
        env = self.env
        if env is None or self.is_server(env) or self._closed or not dist.is_initialized():
            return self.config.synchronous
        self._closed = True
        worker = self.worker
        loads = worker.client.finish() if worker is not None else []
        if self.config.synchronous:
            table = report(
                self.config.servers,
                self.config,
                env.rank,
                worker.client.stats if worker else None,
                self._workers(env),
                loads,
            )
            if table:
                print(table, flush=True)
        return self.config.synchronous


def _timeout() -> timedelta:
    """How long a server or a returning worker waits to meet the other side: the job's process-group timeout."""
    return timedelta(seconds=float(os.environ.get(PG_TIMEOUT_VAR, DEFAULT_PG_TIMEOUT_S)))


def _returns() -> Returns | None:
    """How an asynchronous server learns from ``paratrain run`` whether a worker that died comes back (None outside
    ``paratrain run``: it never does)."""
    store = notice_store(_timeout())
    if store is None:
        return None

    def comes_back(rank: int, n: int) -> bool:
        key = notice_key(rank, n)
        try:
            store.wait([key])
        except RuntimeError:  # the launcher said nothing in time: it is not coming
            return False
        return store.get(key) == BACK

    return Returns(comes_back, store, _timeout())
