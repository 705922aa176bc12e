"""The parameter-server jobs of tests/distributed/test_param_server.py.

A server rank serves from inside ``prepare`` and ends its process when the workers close, so each case is one
launch: :func:`run_zoo` (a zoo model), :func:`run_sparse` (a recommender with tables on the servers; every rank
writes its peak memory to ``folder/<rank>.json``, a server on its way out), :func:`run_async` (the digits CNN with
a slow worker), :func:`run_rogue` (malformed requests) and :func:`run_killed` (a rank SIGKILLed mid-training).
Rank 0 (a worker) returns the final full state dict, the servers' tables included, and ``par.last_grad_norm``
after each step (None unless ``clip_grad_norm`` is among the options).
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from torch import nn
from torch.nn import functional as F

import paratrain
from helpers.zoo import ZOO

STEPS, PER_RANK = 3, 4
ROWS, BAG_ROWS, DIM = 300, 200, 8


def step_batch(spec, step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    return spec.inputs(global_batch, torch.Generator().manual_seed(100 + step))


def _memory_mb(field: str) -> float:
    """``VmRSS`` (now) or ``VmHWM`` (the peak since the last reset) of this process, in MiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def _reset_peak() -> float:
    """Start measuring the peak from here (Linux: ``5`` into clear_refs resets VmHWM); returns the RSS now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _memory_mb("VmRSS")


def run_zoo(model_name: str, options: dict) -> dict | None:
    spec = ZOO[model_name]
    par = paratrain.Parallel("ps", monitor=False, **options)
    model = spec.build()
    model, opt = par.prepare(model, spec.optimizer(model))  # a server serves here and never returns
    size, rank, micro = par.data_parallel_size, par.data_parallel_rank, par.accumulate
    norms = []
    for s in range(STEPS):
        x, y = step_batch(spec, s, size * PER_RANK)
        x, y = (t[rank * PER_RANK : (rank + 1) * PER_RANK].to(par.device) for t in (x, y))
        for m in range(micro):  # with accumulate=k, k micro-steps of PER_RANK / k samples
            part = slice(m * PER_RANK // micro, (m + 1) * PER_RANK // micro)
            with par.step(model, opt):
                par.forward_backward(model, x[part], y[part], spec.loss)
        norms.append(par.last_grad_norm)
    state = par.full_state_dict(model)
    par.close()
    return {"state": state, "workers": size, "norms": norms}


class Recommender(nn.Module):
    """DLRM-like: a bag of ids (summed rows of a big table), one more id from a second table, and an MLP."""

    def __init__(
        self,
        rows: int = ROWS,
        bag_rows: int = BAG_ROWS,
        dim: int = DIM,
        device: str | None = None,
        sparse: bool = False,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bag = nn.EmbeddingBag(bag_rows, dim, mode="sum", sparse=sparse, device=device)
        self.emb = nn.Embedding(rows, dim, sparse=sparse, device=device)
        self.mlp = nn.Sequential(nn.Linear(2 * dim, 16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        bag_ids, ids = x
        return self.mlp(torch.cat([self.bag(bag_ids), self.emb(ids)], dim=1))


def recommender_batch(step: int, n: int, rows: int = ROWS, bag_rows: int = BAG_ROWS):
    g = torch.Generator().manual_seed(200 + step)
    return (torch.randint(0, bag_rows, (n, 3), generator=g), torch.randint(0, rows, (n,), generator=g)), torch.randint(
        0, 2, (n,), generator=g
    )


def recommender_optimizer(model: nn.Module, kind: str) -> list[torch.optim.Optimizer]:
    """``kind`` over the model; with ``adam`` in one process the tables get SparseAdam (``sparse`` embeddings)."""
    if kind == "sgd":
        return [torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)]
    if kind == "adagrad":
        return [torch.optim.Adagrad(model.parameters(), lr=0.3)]
    dense = [p for n, p in model.named_parameters() if n.startswith("mlp")]
    return [torch.optim.Adam(dense, lr=0.05)] + (
        [torch.optim.SparseAdam([model.bag.weight, model.emb.weight], lr=0.05)] if model.bag.sparse else []
    )


def run_sparse(
    kind: str, options: dict, folder: str, rows: int = ROWS, dim: int = DIM, meta: bool = False, steps: int = STEPS
) -> dict | None:
    rank = int(os.environ["RANK"])
    par = paratrain.Parallel("ps", monitor=False, **options)
    model = Recommender(rows=rows, dim=dim, device="meta" if meta else None)
    if meta:
        model.mlp.to_empty(device="cpu")
        torch.manual_seed(0)
        for m in model.mlp:
            if isinstance(m, nn.Linear):
                m.reset_parameters()
    start = _reset_peak()  # the process group and the model's dense part are here: what follows is the table's
    try:
        model, opt = par.prepare(
            model,
            torch.optim.Adam(model.parameters(), lr=0.05) if kind == "adam" else recommender_optimizer(model, kind)[0],
        )
    finally:  # a server leaves prepare only to end its process
        with open(os.path.join(folder, f"{rank}.json"), "w") as f:
            json.dump({"start_mb": start, "peak_mb": _memory_mb("VmHWM")}, f)
    size, dp_rank = par.data_parallel_size, par.data_parallel_rank
    norms = []
    for s in range(steps):
        x, y = recommender_batch(s, size * PER_RANK, rows=rows)
        sl = slice(dp_rank * PER_RANK, (dp_rank + 1) * PER_RANK)
        with par.step(model, opt):
            loss = F.cross_entropy(model((x[0][sl].to(par.device), x[1][sl].to(par.device))), y[sl].to(par.device))
            par.backward(loss)
        norms.append(par.last_grad_norm)
    state = par.full_state_dict(model) if not meta else {}
    par.close()
    with open(os.path.join(folder, f"{rank}.json"), "w") as f:
        json.dump({"start_mb": start, "peak_mb": _memory_mb("VmHWM")}, f)
    return {"state": state, "norms": norms}


def run_async(options: dict, slow_rank: int | None, slow_factor: float, epochs: int) -> dict | None:
    """The digits CNN with Adam; rank ``slow_rank`` sleeps ``slow_factor - 1`` times its own step time after each
    step. Returns this worker's samples/s and steps, and (rank 0) the test accuracy of the servers' final
    parameters."""
    import time

    from torch.utils.data import DataLoader

    from paratrain.workloads.digits import digits_cnn, load_digits_split

    par = paratrain.Parallel("ps", monitor=False, seed=0, **options)
    train_set, test_set = load_digits_split(seed=0)
    model = digits_cnn()
    model, opt = par.prepare(model, torch.optim.Adam(model.parameters(), lr=2e-3))
    loader = par.prepare(DataLoader(train_set, batch_size=16, shuffle=True, drop_last=True))
    seen, start, steps = 0, time.perf_counter(), 0
    for _ in par.epochs(epochs):
        for x, y in loader:
            t0 = time.perf_counter()
            with par.step(model, opt):
                par.forward_backward(model, x, y, F.cross_entropy)
            if par.rank == slow_rank:
                time.sleep((slow_factor - 1) * (time.perf_counter() - t0))
            seen += len(y)
            steps += 1
    wall = time.perf_counter() - start
    stats = par.strategy.server.worker.client.stats
    state = par.full_state_dict(model, rank0_only=False)  # the servers' parameters now
    par.close()
    acc = None
    if par.rank == 0:
        final = digits_cnn()
        final.load_state_dict(state)
        x = torch.stack([s[0] for s in test_set])
        y = torch.tensor([int(s[1]) for s in test_set])
        with torch.no_grad():
            acc = float((final(x).argmax(1) == y).float().mean())
    return {
        "samples_per_s": seen / wall,
        "steps": steps,
        "accuracy": acc,
        "dropped": stats.dropped,
        "max_staleness": stats.max_staleness,
    }


def run_resume(case: str, options: dict, folder: str, steps: int = 4, at: int = 2) -> dict | None:
    """``case`` (a zoo model, or ``"sparse"``: the recommender with Adam and SparseAdam tables) trained ``steps``
    steps with an LR schedule, saved after step ``at``; then that checkpoint is loaded into the same job (the
    servers read their shards and optimizer states back) and steps ``at``.. are trained again. Rank 0 returns the
    state at the save and at both ends."""
    par = paratrain.Parallel("ps", monitor=False, **options)
    if case == "sparse":
        model = Recommender()
        opt, loss_fn = torch.optim.Adam(model.parameters(), lr=0.05), F.cross_entropy
    else:
        spec = ZOO[case]
        model = spec.build()
        opt, loss_fn = spec.optimizer(model), spec.loss
    model, opt = par.prepare(model, opt)
    schedule = par.prepare(torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s)))
    size, rank = par.data_parallel_size, par.data_parallel_rank
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)

    def train(start: int, end: int) -> dict:
        for s in range(start, end):
            if case == "sparse":
                x, y = recommender_batch(s, size * PER_RANK)
                x, y = (x[0][mine], x[1][mine]), y[mine]
            else:
                x, y = step_batch(spec, s, size * PER_RANK)
                x, y = x[mine], y[mine]
            with par.step(model, opt):
                par.forward_backward(model, x, y, loss_fn)
            schedule.step()
        return par.full_state_dict(model)

    saved = train(0, at)
    path = par.save(folder)
    first = train(at, steps)
    par.load(path)
    again = train(par.optimizer_steps, steps)
    broken = os.path.join(folder, "broken", path.name)  # as a job with one server fewer would have saved it
    if par.rank == 0:
        shutil.copytree(path, broken)
        gone = f"server-{par.strategy.config.servers - 1:03d}"
        shutil.rmtree(os.path.join(broken, gone))
        with open(os.path.join(broken, "meta.json")) as f:
            meta = json.load(f)
        meta["files"] = {name: size for name, size in meta["files"].items() if not name.startswith(f"{gone}/")}
        with open(os.path.join(broken, "meta.json"), "w") as f:
            json.dump(meta, f)
    par.barrier()
    try:
        par.load(broken)
        refused = ""
    except paratrain.errors.CheckpointError as err:  # on every worker alike, before anything is loaded
        refused = str(err)
    after = par.full_state_dict(model)
    damaged = os.path.join(folder, "damaged", path.name)  # the last server's tensor file scrambled, its size kept
    if par.rank == 0:
        shutil.copytree(path, damaged)
        shard = os.path.join(damaged, f"server-{par.strategy.config.servers - 1:03d}", "__0_0.distcp")
        with open(shard, "rb") as f:
            data = f.read()
        with open(shard, "wb") as f:
            f.write(data.translate(bytes((b * 7 + 3) % 256 for b in range(256))))
    par.barrier()
    try:
        par.load(damaged)
        unreadable = ""
    except paratrain.errors.CheckpointError as err:  # on every worker alike; the servers serve on
        unreadable = str(err)
    par.close()
    return {
        "saved": saved,
        "first": first,
        "again": again,
        "path": str(path),
        "refused": refused,
        "after": after,
        "unreadable": unreadable,
    }


def _linear_job(options: dict):
    par = paratrain.Parallel("ps", monitor=False, **options)
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    return par, model, torch.optim.SGD(model.parameters(), lr=0.1)


def linear_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    return torch.randn(PER_RANK, 6, generator=g), torch.randn(PER_RANK, 3, generator=g)


def run_rogue(steps: int) -> dict | None:
    """Rank 1 sends the server (rank 2) malformed requests; rank 0 trains a linear model meanwhile."""
    import torch.distributed as dist

    from paratrain.distributed.param_server import messages as m

    par, model, opt = _linear_job({"servers": 1})
    if par.rank != 1:
        model, opt = par.prepare(model, opt)
        for s in range(steps):
            x, y = linear_batch(s)
            with par.step(model, opt):
                par.backward(F.mse_loss(model(x), y))
        state = par.full_state_dict(model)
        par.barrier()  # the workers' (the server is serving)
        par.close()
        return {"state": state}
    # what prepare does on every rank before any rank's strategy takes over: rank 0's initial weights and seed
    from paratrain.distributed.initial_state import start_alike
    from paratrain.draws import agreed_seed

    start_alike(model, None, par.device, print)
    agreed_seed(None, par.device)
    codes = []

    def ask(header: list[int], payload: torch.Tensor | None = None) -> None:
        dist.send(torch.tensor(header, dtype=torch.int64), 2, tag=m.REQUEST_TAG)
        if payload is not None:
            dist.send(payload, 2, tag=m.PAYLOAD_TAG)
        answer = torch.zeros(m.HEADER_WORDS, dtype=torch.int64)
        dist.recv(answer, 2, tag=m.REPLY_TAG)
        codes.append((int(answer[1]), int(answer[6])))

    f64 = m.DTYPE_CODES[torch.float64]
    f32 = m.DTYPE_CODES[torch.float32]
    # a push of float64 gradients (its group's learning rate, the max norm, one value), where the server holds float32
    ask([m.MAGIC, m.PUSH_DENSE, 0, 0, 1, 1, f64, m.END], m.pack(torch.zeros(3, dtype=torch.float64)))
    # the right dtype, the wrong number of values (the server holds 6 x 3 + 3 = 21)
    ask([m.MAGIC, m.PUSH_DENSE, 0, 0, 5, 1, f32, m.END], m.pack(torch.zeros(2, dtype=torch.float64), torch.zeros(5)))
    # rows of a table that does not exist
    ask([m.MAGIC, m.PULL_ROWS, 0, 7, 2, 0, 0, m.END], m.pack(torch.tensor([0, 1])))
    # announces 1e9 values: refused unread, and the sender is refused from then on
    ask([m.MAGIC, m.PUSH_DENSE, 0, 0, 10**9, 1, f32, m.END])
    ask([m.MAGIC, m.PULL_DENSE, 0, 0, 0, 0, 0, m.END])
    par.barrier()
    par.close()
    return {"codes": codes}


def run_killed(victim: int, folder: str, steps: int = 50) -> dict | None:
    """Every rank notes its pid; after step 2 rank 0 SIGKILLs ``victim`` (a worker or a server), then trains on."""
    import signal
    import time

    par, model, opt = _linear_job({"servers": 1})
    with open(os.path.join(folder, f"{par.rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    model, opt = par.prepare(model, opt)
    for s in range(steps):
        x, y = linear_batch(s)
        with par.step(model, opt):
            par.backward(F.mse_loss(model(x), y))
        if s == 2 and par.rank == 0:
            time.sleep(0.5)  # every pid file is written by now
            with open(os.path.join(folder, f"{victim}.pid")) as f:
                pid = int(f.read())
            with open(os.path.join(folder, "killed_at"), "w") as f:
                f.write(str(time.time()))
            os.kill(pid, signal.SIGKILL)
    par.close()
    return {}


def clip_one_process(model: torch.nn.Module, clip: float | None, norms: list[float]) -> None:
    """``clip_grad_norm_`` as one process does it (a sparse table gradient counted as its dense form); the norm is
    appended to ``norms``."""
    if clip is None:
        return
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad.to_dense() if p.grad.is_sparse else p.grad for p in params])
    torch.nn.utils.clip_grads_with_norm_(params, clip, norm)
    norms.append(float(norm))


def zoo_reference(
    model_name: str, replicas: int, micro: int = 1, clip: float | None = None, norms: list[float] | None = None
) -> dict[str, torch.Tensor]:
    """One process on the global batch, in ``replicas x micro`` slices (the mean of their losses); ``clip``: its
    gradient norm clipped to that, each step's norm appended to ``norms``."""
    spec = ZOO[model_name]
    model = spec.build()
    opt = spec.optimizer(model)
    size = PER_RANK // micro
    for s in range(STEPS):
        x, y = step_batch(spec, s, replicas * PER_RANK)
        for r in range(replicas * micro):
            sl = slice(r * size, (r + 1) * size)
            (spec.loss(model(x[sl]), y[sl]) / (replicas * micro)).backward()
        clip_one_process(model, clip, norms if norms is not None else [])
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def sparse_reference(
    kind: str, replicas: int, clip: float | None = None, norms: list[float] | None = None
) -> dict[str, torch.Tensor]:
    model = Recommender(sparse=True)
    opts = recommender_optimizer(model, kind)
    for s in range(STEPS):
        x, y = recommender_batch(s, replicas * PER_RANK)
        for r in range(replicas):
            sl = slice(r * PER_RANK, (r + 1) * PER_RANK)
            (F.cross_entropy(model((x[0][sl], x[1][sl])), y[sl]) / replicas).backward()
        clip_one_process(model, clip, norms if norms is not None else [])
        for o in opts:
            o.step()
            o.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
