"""``ps``: parameter-server training. The last ``servers`` ranks hold the parameters and their optimizer; the other
ranks train, pulling parameters and pushing gradients (:mod:`paratrain.distributed.param_server`).

``Parallel("ps", servers=1, staleness=0)``: synchronous by default (every step equals one process on the global
batch); ``staleness=tau`` applies each push as it arrives unless it was computed on parameters more than tau updates
old, so a slow worker holds no one back. A server rank serves from inside ``prepare`` (model, then optimizer) and
ends its process when every worker has closed; the code after ``prepare`` runs on the workers only.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint.single import read_alone, write_alone
from ..dims import ParallelDims
from ..distributed.param_server.config import PSConfig
from ..distributed.param_server.layout import Layout, plan_layout
from ..distributed.param_server.messages import ProtocolError
from ..distributed.param_server.roles import WorkerSide, report, serve, shard_folder
from ..distributed.param_server.snapshot import ShardStore
from ..distributed.param_server.worker import PushingOptimizer
from ..distributed.process_group import finish_group
from ..env import ClusterEnv
from ..errors import CheckpointError, ConfigError
from .base import Runtime, Strategy
from .registry import register


@register("ps")
class ParameterServer(Strategy):
    name = "ps"
    serves = True
    host_messages = True

    def __init__(self, config: PSConfig | None = None, **options: Any) -> None:
        if config is not None and options:
            raise ConfigError(f"strategy 'ps' got options {sorted(options)} beside a PSConfig; set them on it")
        self.config = config if config is not None else PSConfig(**options)
        self.worker: WorkerSide | None = None
        self._model: nn.Module | None = None
        self._layout: Layout | None = None
        self._group: dist.ProcessGroup | None = None
        self._env: ClusterEnv | None = None
        self._closed = False

    def validate(self, env: ClusterEnv) -> None:
        self.config.check_world(env.world_size)
        self._env = env

    def dims(self, env: ClusterEnv) -> ParallelDims:
        return ParallelDims(dp_replicate=env.world_size)

    def is_server(self, env: ClusterEnv) -> bool:
        return env.rank >= env.world_size - self.config.servers

    def on_host(self, env: ClusterEnv) -> bool:
        return self.is_server(env)

    def materializer(self, model: nn.Module, device: torch.device, init_fn: Any) -> None:
        """None: a table built on the meta device is allocated row-shard by row-shard on the servers, and a worker
        keeps its copy on meta (it pulls the rows its batch reads)."""
        if init_fn is not None:
            raise ConfigError("strategy 'ps' initializes a meta-built table on its servers; drop init_fn")
        return None

    def wrap_model(self, model: nn.Module, rt: Runtime) -> nn.Module:
        if self.worker is not None or self._model is not None:
            raise ConfigError("strategy 'ps' prepares one model per Parallel object")
        if dist.is_initialized() and "gloo" not in str(dist.get_backend()):
            raise ConfigError(f"ps sends its messages as host tensors received from any worker, which the "
                              f"{dist.get_backend()} backend cannot; let Parallel start the group, or start it with "
                              "backend='cpu:gloo,cuda:nccl'")
        layout = plan_layout(model, rt.env.world_size, self.config)
        if self.is_server(rt.env):
            self._layout, self._model = layout, model  # served once the optimizer is known
            return model
        self.worker = WorkerSide(model, layout, rt.env.rank, self.config, rt.device)
        return model

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module, rt: Runtime) -> torch.optim.Optimizer:
        if self.worker is not None:
            return self.worker.optimizer(optimizer, model)
        assert self._model is not None and self._layout is not None
        model, self._model = self._model, None
        serve(model, optimizer, self._layout, rt.env.rank, self.config, ShardStore(write_alone, read_alone))
        finish_group()  # meets the workers' Parallel.close, which waits for every rank before the group goes
        raise SystemExit(0)  # training is over: the workers' results are the job's

    def data_parallel(self, rt: Runtime) -> tuple[int, int, dist.ProcessGroup | None]:
        workers = rt.env.world_size - self.config.servers
        if self.is_server(rt.env):
            return 0, 1, None  # a server reads no data
        return rt.env.rank, workers, self.training_group(rt.env)

    def training_group(self, env: ClusterEnv) -> dist.ProcessGroup | None:
        return self._workers(env)

    def _workers(self, env: ClusterEnv) -> dist.ProcessGroup | None:
        """The workers' own group (made by the workers alone: the servers are serving); None on a server."""
        if self.is_server(env) or not dist.is_initialized():
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

    def full_state_dict(self, model: nn.Module, rank0_only: bool) -> dict[str, torch.Tensor]:
        if self.worker is None:
            return {}
        return self.worker.full_state(model) if not rank0_only or self.worker.client.rank == 0 else {}

    # ----------------------------------------------------------------- checkpoints
    def checkpoint_group(self) -> dist.ProcessGroup | None:
        """The workers save and load together; the servers, serving, take part through their messages."""
        return self._workers(self._env) if self._env is not None else None

    def save_shards(self, folder: Path, rank: int) -> None:
        """Rank 0 has every server write its shard into ``folder/server-NNN`` (the workers are all between steps:
        they are inside ``save``), and waits for them."""
        if self.worker is not None and rank == 0:
            self._servers_do(folder, load=False)

    def load_shards(self, folder: Path, rank: int) -> None:
        """Rank 0 has every server read its shard back; then every worker pulls the restored parameters. A server's
        refusal is raised on rank 0 after the barrier the others wait in (the caller makes every rank fail alike)."""
        if self.worker is None:
            return
        refused = None
        if rank == 0:
            try:
                self._servers_do(folder, load=True)
            except CheckpointError as err:
                refused = err
        dist.barrier(group=self._workers(self._env))  # every server has answered before anyone pulls
        if refused is not None:
            raise refused
        self.worker.client.pull_dense()

    def check_shards(self, folder: Path) -> None:
        saved = len([p for p in folder.iterdir() if p.is_dir() and p.name.startswith("server-")])
        if saved != self.config.servers or any(not Path(f).is_dir() for f in self._shard_folders(folder)):
            raise CheckpointError(f"checkpoint {folder} holds the shards of {saved} parameter server(s), this job has "
                                  f"{self.config.servers}; load it with servers={saved} (shards are cut per server)")

    def _servers_do(self, folder: Path, load: bool) -> None:
        try:
            self.worker.client.checkpoint(self._shard_folders(folder), load=load)
        except ProtocolError as err:
            raise CheckpointError(f"a parameter server could not {'read' if load else 'write'} its shard: "
                                  f"{err}") from None

    def _shard_folders(self, folder: Path) -> list[str]:
        return [str((folder / shard_folder(i)).absolute()) for i in range(self.config.servers)]

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
        if self.worker is None:
            return None
        stats = self.worker.client.stats
        return stats.push_bytes + stats.pull_bytes

    def close(self) -> None:
        """On a worker: tell the servers it is done, then the table of pulls, pushes and the servers' load (rank 0
        prints it)."""
        env = self._env
        if env is None or self.is_server(env) or self._closed or not dist.is_initialized():
            return
        self._closed = True
        worker = self.worker
        loads = worker.client.finish() if worker is not None else []
        table = report(self.config.servers, self.config, env.rank, worker.client.stats if worker else None,
                       self._workers(env), loads)
        if table:
            print(table, flush=True)

    def describe(self) -> str:
        c = self.config
        return f"ps(servers={c.servers}, {'sync' if c.synchronous else f'staleness={c.staleness}'})"
