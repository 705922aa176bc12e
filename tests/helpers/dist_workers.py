"""Module-level functions that tests run on several processes through ``paratrain.launch``."""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import paratrain


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
    )


def global_batches(steps: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    n = steps * global_batch
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def train_params(
    strategy: str,
    accumulate: int,
    steps: int,
    per_rank_batch: int,
    world: int,
    options: dict | None = None,
    **parallel_kwargs: object,
) -> dict[str, torch.Tensor]:
    """``steps`` optimizer steps; each reads a global batch of replicas x accumulate x per_rank_batch samples.

    Each data-parallel replica takes its slice of every micro-batch (the stages of a pipeline read the same
    one), so any world size trains on the same global batches.
    """
    par = paratrain.Parallel(strategy, accumulate=accumulate, **parallel_kwargs, **(options or {}))
    model = build_model()
    model, opt = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    replicas, r = par.data_parallel_size, par.data_parallel_rank
    micro = replicas * per_rank_batch
    x, y = global_batches(steps * accumulate, micro)
    for s in range(steps * accumulate):
        xs = x[s * micro : (s + 1) * micro][r * per_rank_batch : (r + 1) * per_rank_batch].to(par.device)
        ys = y[s * micro : (s + 1) * micro][r * per_rank_batch : (r + 1) * per_rank_batch].to(par.device)
        with par.step(model, opt):
            par.forward_backward(model, xs, ys, nn.functional.cross_entropy)
    out = par.full_state_dict(model, rank0_only=False)
    par.close()
    return out


def split_evaluation(evenly: bool, options: dict, examples: int = 5) -> dict[str, object]:
    """An evaluation split over the ranks as scripts split it (``i % world == rank``: 3 and 2 examples at 2 ranks)
    under zero3: through ``par.map_evenly`` (``evenly``), or a plain loop, whose one line is kept before the ranks
    meet again in ``par.sum``; the loss summed over every example."""
    par = paratrain.Parallel("zero3", monitor=False, **options)
    model = build_model()
    model, _ = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
    x, y = global_batches(1, examples)
    mine = [i for i in range(examples) if i % par.world_size == par.rank]

    def score(i: int) -> torch.Tensor:
        return nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1], reduction="sum")

    line, total = None, torch.zeros(())
    with torch.no_grad():
        if evenly:
            total = sum(par.map_evenly(score, mine), total)
        else:
            try:
                for i in mine:
                    total = total + score(i)
            except paratrain.ParatrainError as err:
                line = str(err)
    out = {"total": float(par.sum(total)), "line": line}
    par.close()
    return out


def epoch_indices(n: int, epochs: int, batch: int, even: bool) -> list[list[int]]:
    """The sample indices this rank read in each epoch through a prepared loader."""
    par = paratrain.Parallel("ddp")
    loader = DataLoader(TensorDataset(torch.arange(n)), batch_size=batch, shuffle=True)
    loader = par.prepare_loader(loader, even=even)
    seen = [[int(i) for (b,) in loader for i in b] for _ in par.epochs(epochs)]
    par.close()
    return seen


class _RandomItems(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> float:
        return torch.rand(()).item()


def seeding_probe(seed: int) -> dict[str, object]:
    """What a rank sees of seeding: its init weights, its first random draw after prepare, its worker draws."""
    par = paratrain.Parallel("ddp", seed=seed)
    model = nn.Linear(4, 4)
    init = model.weight.detach().clone()
    model = par.prepare(model)
    after = torch.rand(3)
    loader = par.prepare_loader(DataLoader(_RandomItems(), batch_size=4, num_workers=1))
    worker_draws = [b.tolist() for b in loader]
    par.close()
    return {"init": init, "after": after, "worker": worker_draws}


def reductions() -> tuple[float, float, list[float], int, int, float]:
    par = paratrain.Parallel("ddp")
    r = par.rank
    out = (
        par.mean(float(r)),
        par.sum(r + 1.0),
        par.mean(torch.tensor([r, 2.0 * r])).tolist(),
        int(par.sum(torch.tensor(r + 1))),
        par.sum(30 - r),
        par.mean(r),
    )
    par.barrier()
    par.close()
    return out


def existing_group_is_reused() -> tuple[bool, bool]:
    """Inside a job whose group the caller started (``helpers.cases.each_call``, as a script would): whether
    ``Parallel`` took that group as its own, and whether the group is still up after ``close``."""
    par = paratrain.Parallel("ddp")
    par.close()  # must not destroy a group it did not create
    return par._session.owns_group, dist.is_initialized()


def fail_at(rank: int, step: int, how: str, pid_dir: str) -> None:
    """Train until ``step``, then rank ``rank`` raises or SIGKILLs itself."""
    import signal

    par = paratrain.Parallel("ddp")
    with open(os.path.join(pid_dir, f"{par.rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    model = nn.Linear(4, 1)
    model, opt = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for s in range(100_000):
        if par.rank == rank and s == step:
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError(f"planted failure at step {s}")
        with par.step(model, opt):
            par.backward(model(torch.randn(8, 4)).pow(2).mean())
        time.sleep(0.01)


def sleep_forever(pid_dir: str | None = None) -> None:
    """Sleep; with ``pid_dir``, record the pid and ignore Ctrl-C, like a rank stuck inside a collective."""
    if pid_dir is not None:
        import signal

        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with open(os.path.join(pid_dir, f"{os.environ['RANK']}.pid"), "w") as f:
            f.write(str(os.getpid()))
    time.sleep(3600)


def rank_and_threads() -> tuple[int, int, int]:
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), torch.get_num_threads()


def _local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def state_bytes(strategy: str, blocks: int = 8, width: int = 64) -> dict[str, int]:
    """Per-rank bytes of parameters (largest of at rest and between forward and backward), gradients and
    Adam state, counted from the local tensors/shards this rank holds."""
    par = paratrain.Parallel(strategy, **({"min_params": 1000} if strategy in ("zero2", "zero3") else {}))
    model = state_model(blocks, width)
    model, opt = par.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    x = torch.randn(4, width)
    with par.step(model, opt):
        at_rest = sum(_local_bytes(p) for p in model.parameters())
        loss = model(x).pow(2).mean()
        in_step = sum(_local_bytes(p) for p in model.parameters())
        par.backward(loss)
        grads = sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer keeps this rank's shard in .optim
    optim_state = sum(
        _local_bytes(v) for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    par.close()
    return {
        "params": max(at_rest, in_step),
        "grads": grads,
        "optim": optim_state,
        "full_params": sum(p.numel() * 4 for p in state_model(blocks, width).parameters()),
    }


def state_model(blocks: int = 8, width: int = 64) -> nn.Sequential:
    """The model the state-accounting tests shard (also a factory the planner can load)."""
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(blocks)])


class _LiveBytes:
    """Bytes of tensors autograd saved for backward that are still alive, and their peak."""

    def __init__(self) -> None:
        self.now = self.peak = 0

    def pack(self, t: torch.Tensor) -> _Saved:
        return _Saved(t, self)


class _Saved:
    def __init__(self, t: torch.Tensor, live: _LiveBytes) -> None:
        self.t, self.live, self.n = t, live, t.numel() * t.element_size()
        live.now += self.n
        live.peak = max(live.peak, live.now)

    def __del__(self) -> None:
        self.live.now -= self.n


def peak_saved_activations(schedule: str, microbatches: int) -> int:
    """Peak bytes of saved activations on this rank during one pipelined batch."""
    par = paratrain.Parallel("pipeline", schedule=schedule, microbatches=microbatches)
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(64, 64), nn.Tanh())])
    model = par.prepare(model)
    x, y = torch.randn(8 * microbatches, 64), torch.randn(8 * microbatches, 64)
    live = _LiveBytes()
    with torch.autograd.graph.saved_tensors_hooks(live.pack, lambda saved: saved.t):
        par.forward_backward(model, x, y, nn.functional.mse_loss)
    par.close()
    return live.peak


def _size(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _received(fn: Callable[..., object], args: tuple, kwargs: dict) -> int:
    """Bytes a call of ``torch.distributed``'s ``fn`` brings this rank."""
    name, call = fn.__name__, inspect.signature(fn).bind(*args, **kwargs).arguments
    if name == "broadcast":
        src = call.get("src")
        if call.get("group_src") is not None:
            src = dist.get_global_rank(call.get("group"), call["group_src"])
        return 0 if src == dist.get_rank() else _size(call["tensor"])
    if name == "recv":
        return _size(call["tensor"])
    gathered = call.get("tensor_list") if name == "all_gather" else call.get("gather_list")
    return sum(map(_size, gathered)) - _size(call["tensor"]) if gathered else 0


@contextmanager
def received_bytes() -> Iterator[list[int]]:
    """Inside: ``[bytes]`` this rank receives by ``broadcast``, ``recv``, ``all_gather`` and ``gather`` (the object
    collectives send through these), counted at each call; the pipeline schedules' own sends are not counted."""
    from torch.distributed import distributed_c10d as c10d

    total = [0]
    inner = {name: getattr(c10d, name) for name in ("broadcast", "recv", "all_gather", "gather")}

    def counting(name: str) -> Callable[..., object]:
        def call(*args: object, **kwargs: object) -> object:
            total[0] += _received(inner[name], args, kwargs)
            return inner[name](*args, **kwargs)

        return call

    for name in inner:
        setattr(c10d, name, counting(name))
        setattr(dist, name, getattr(c10d, name))
    try:
        yield total
    finally:
        for name, fn in inner.items():
            setattr(c10d, name, fn)
            setattr(dist, name, fn)


def pipeline_traffic(strategy: str) -> dict[str, object]:
    """Bytes this rank receives for a consolidated state dict (rank 0's), an every-rank one and bf16-mixed
    evaluations of 64 samples x 256 outputs, for every rank and for the last stage alone (``eval_outputs``; each past
    its first batch, which makes its schedule); its own stage's and the whole model's state bytes, the outputs."""
    out: dict[str, object] = {}
    for outputs in ("every", "last"):
        par = paratrain.Parallel(strategy, precision="bf16-mixed", monitor=False, eval_outputs=outputs)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 256))
        whole = sum(map(_size, model.state_dict().values()))
        model = par.prepare(model)
        if outputs == "every":
            own = sum(map(_size, model.state_dict().values()))
            with received_bytes() as rank0:
                consolidated = par.full_state_dict(model)
            with received_bytes() as every:
                par.full_state_dict(model, rank0_only=False)
            out.update(
                rank0_only=rank0[0], every=every[0], own=own, whole=whole, keys=len(consolidated), last=model.is_last
            )
        model.eval()
        x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            model(x)
            with received_bytes() as evaluation:
                out[f"out {outputs}"] = model(x)
        out[f"eval {outputs}"] = evaluation[0]
        par.close()
    return out


def pipeline_bad_inputs() -> list[str]:
    """One-line errors for pipeline misuse, collected on every rank (each error is raised on all ranks).

    Run inside a job's group (``helpers.cases.each_call``): the Parallel objects below use it and leave it alone.
    """
    errors = []
    cases = [
        ({"split": [9]}, build_model(), 8),  # cut point past the last layer
        ({}, nn.Linear(4, 4), 8),  # not an nn.Sequential
        ({"microbatches": 3}, build_model(), 8),  # 8 samples do not split into 3
    ]
    for options, model, batch in cases:
        par = paratrain.Parallel("pipeline", **options)
        try:
            model = par.prepare(model)
            par.forward_backward(
                model, torch.randn(batch, 8), torch.randint(0, 4, (batch,)), nn.functional.cross_entropy
            )
        except paratrain.ConfigError as err:
            errors.append(str(err))
    return errors


def backend_and_device() -> tuple[str, str]:
    par = paratrain.Parallel("ddp")
    out = (dist.get_backend(), str(par.device))
    par.close()
    return out


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 1)
        self.spare = nn.Linear(4, 1)  # never called: DDP waits for its gradient forever

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def unused_parameter_error() -> str:
    """The error a DDP model with a parameter that gets no gradient raises at its next step."""
    par = paratrain.Parallel("ddp")
    model = _TwoHeads()
    model, opt = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        for _ in range(2):
            with par.step(model, opt):
                par.backward(model(torch.randn(2, 4)).sum())
    except paratrain.ConfigError as err:
        return str(err)
    finally:
        dist.destroy_process_group()
    return ""


def where_started(name: str) -> tuple[str | None, str, bool]:
    """A variable of the caller's environment, the working directory and whether a module the test suite preloads
    (transformers' Llama) was imported before the rank's own code ran (true under the fork server)."""
    import os
    import sys

    return os.environ.get(name), os.getcwd(), "transformers.models.llama.modeling_llama" in sys.modules
