"""The things a benchmark times on one rank: a paratrain-prepared model, or a hand-written DDP loop beside it.

Both take the same workload, seed and data, so their step times and final parameters can be compared.
"""

from __future__ import annotations

import io
from contextlib import nullcontext, redirect_stdout
from typing import Any

import torch

from ..batch import ModelCall
from ..monitor import MonitorConfig
from ..parallel import Parallel
from ..strategies.data_engines import all_reduce_traffic
from ..workloads import Workload


class ParatrainSubject:
    """A ``Parallel``-prepared model and optimizer of one strategy (on the job's process group)."""

    def __init__(self, workload: Workload, strategy: str, options: dict, seed: int, accelerator: str) -> None:
        # the monitor stays on, as users have it, but its end-of-run table would break into the bench's output
        self.par = Parallel(strategy, accelerator=accelerator, monitor=MonitorConfig(summary=False), **options)
        torch.manual_seed(seed)
        model = workload.model()
        self.model, self.optimizer = self.par.prepare(model, workload.optimizer(model.parameters()))
        self.loss = workload.loss
        self.device = self.par.device
        self.replicas, self.replica_rank = self.par.data_parallel_size, self.par.data_parallel_rank

    def step(self, x: torch.Tensor, y: Any) -> None:
        with self.par.step(self.model, self.optimizer):
            self.par.forward_backward(self.model, x, y, self.loss)

    @property
    def can_skip_sync(self) -> bool:
        """True when the strategy's ``no_sync`` really leaves gradient communication out (not for pipelines)."""
        return self.par.world_size > 1 and not isinstance(self.par.strategy.no_sync(self.model), nullcontext)

    def barrier(self) -> None:
        """Line up the ranks that train (a parameter server's servers are serving)."""
        self.par.barrier()

    def bytes_moved(self) -> int | None:
        """Bytes this rank has sent plus received for its model so far, as its strategy counts them (None: not)."""
        return self.par.strategy.traffic_bytes(self.model, self.par.optimizer_steps)

    def seconds_moving(self) -> float | None:
        """Seconds this rank has spent in its strategy's own messages so far, as the strategy times them."""
        return self.par.strategy.server.traffic_seconds()

    def forward_backward(self, x: torch.Tensor, y: Any, *, sync: bool) -> None:
        """A forward and backward with or without gradient synchronisation; gradients are dropped, the
        parameters stay as they are (FSDP's gradients kept back by ``no_sync`` go out with the next synced pass)."""
        with nullcontext() if sync else self.par.strategy.no_sync(self.model):
            self.par.forward_backward(self.model, x, y, self.loss)
        self.optimizer.zero_grad(set_to_none=True)

    def close(self) -> None:
        with redirect_stdout(io.StringIO()):  # a strategy's closing table (ps's) would break into the bench's output
            self.par.close()


class TorchDDPSubject:
    """The loop people write by hand from the PyTorch DDP tutorial: ``DDP(model)``, backward, step, zero_grad."""

    def __init__(self, workload: Workload, seed: int, device: torch.device) -> None:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        torch.manual_seed(seed)
        model = workload.model().to(device)
        self.model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        self.optimizer = workload.optimizer(self.model.parameters())
        self.loss = workload.loss
        self.device = device
        self.replicas, self.replica_rank = dist.get_world_size(), dist.get_rank()
        self.can_skip_sync = False  # only paratrain's runs are probed
        self.steps = 0

    def step(self, x: torch.Tensor, y: Any) -> None:
        call = ModelCall.of(x, y, self.loss, {})  # the model's own loss read as forward_backward reads it
        call.loss(call.forward(self.model)).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def bytes_moved(self) -> int:
        """The gradient all-reduce's bytes so far, computed as paratrain's ddp computes its own."""
        return self.steps * all_reduce_traffic(self.model.module, self.replicas)

    def seconds_moving(self) -> None:
        return None  # its all-reduce overlaps the backward pass: the probe measures what the step waits for

    def close(self) -> None:
        pass
