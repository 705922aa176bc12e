"""The training code that ``ddp_overhead.py`` times: one MLP, one fixed batch, paratrain and raw-DDP steps.

Worker functions are module-level so that ``paratrain.launch`` can pickle them for spawned processes.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import paratrain

LR = 0.01
Step = Callable[[], None]


def build_mlp(seed: int = 0) -> nn.Module:
    """MLP 784-1024-1024-10 (1.86 M parameters), initialised identically for a given seed."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def make_batch(batch: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed random batch, different on every rank (so unsynchronised gradients would show)."""
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(batch, 784, generator=g), torch.randint(0, 10, (batch,), generator=g)


def paratrain_step(par: paratrain.Parallel, model: nn.Module, opt: torch.optim.Optimizer,
                   x: torch.Tensor, y: torch.Tensor) -> Step:
    def step() -> None:
        with par.step(model, opt):
            par.backward(F.cross_entropy(model(x), y))
    return step


def torch_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> Step:
    def step() -> None:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def timed_block(step: Step, warmup: int, steps: int) -> list[float]:
    """Warm up, line the ranks up, then time each of ``steps`` steps (seconds)."""
    for _ in range(warmup):
        step()
    dist.barrier()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


@torch.no_grad()
def checksum(model: nn.Module) -> float:
    """Sum of |parameters|: equal on every rank exactly when the replicas are identical."""
    return float(sum(p.double().abs().sum() for p in model.parameters()))


@torch.no_grad()
def max_abs_diff(a: nn.Module, b: nn.Module) -> float:
    return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def step_time_worker(rounds: int, warmup: int, steps: int, batch: int) -> dict:
    """Both models in the same processes on one process group; timed blocks alternate, order flipped each round."""
    dist.init_process_group("gloo")  # Parallel finds it and shares it
    rank = dist.get_rank()
    par = paratrain.Parallel("ddp")
    model = build_mlp()
    pt_model, pt_opt = par.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
    raw_model = DDP(build_mlp())
    raw_opt = torch.optim.SGD(raw_model.parameters(), lr=LR)
    x, y = make_batch(batch, rank)
    runs = {"paratrain": paratrain_step(par, pt_model, pt_opt, x, y), "torch": torch_step(raw_model, raw_opt, x, y)}
    times: dict[str, list[list[float]]] = {name: [] for name in runs}
    for r in range(rounds):
        for name in (list(runs) if r % 2 == 0 else list(reversed(runs))):
            times[name].append(timed_block(runs[name], warmup, steps))
    result = {"times": times, "checksums": {"paratrain": checksum(pt_model), "torch": checksum(raw_model)},
              "max_param_diff": max_abs_diff(pt_model, raw_model)}
    dist.destroy_process_group()
    return result


def throughput_worker(strategy: str, global_batch: int, warmup: int, steps: int) -> float:
    """Seconds for ``steps`` paratrain steps on a fixed global batch split over the ranks (until the last rank ends)."""
    with paratrain.Parallel(strategy) as par:
        model = build_mlp()
        model, opt = par.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
        step = paratrain_step(par, model, opt, *make_batch(global_batch // par.world_size, par.rank))
        for _ in range(warmup):
            step()
        par.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        par.barrier()
        return time.perf_counter() - t0
