"""``Parallel("ps")`` against ``Parallel("ddp")`` on CPU/gloo: a dense MLP, a recommender with a big table, and a
straggler (sync against async parameter servers). Every subject is one launched job; the subjects of a workload
take turns in every round, the order reversed every other round; medians over rounds.

    .venv/bin/python benchmarks/ps.py                         # 3 rounds of every workload (about 5 min here)
    .venv/bin/python benchmarks/ps.py --rounds 1 --steps 10   # a quick look
    .venv/bin/python benchmarks/ps.py --rounds 3 --json benchmarks/ps-2026-11-25.json      # RESULTS.md §16

Workloads (``--which``):

* ``dense``: MLP 784-1024-1024-10 (1.86 M parameters, 7.1 MiB of fp32), SGD, batch 64 per worker. ``ddp`` on 2
  processes against ``ps`` with 1 server + 2 workers (the same two training processes, plus the server);
* ``sparse``: a recommender (``paratrain.workloads.recommender``, the bench's ``recommender`` workload): an
  ``nn.EmbeddingBag`` of 1 M x 32 rows (122 MiB) summing 8 ids per sample, and an MLP 32-256-256-2; batch 256 per
  worker; Adagrad. ``ddp`` on 2 processes (the table replicated, its whole
  gradient all-reduced every step: the default nn.EmbeddingBag) against ``ps`` with 1 server + 2 workers (the
  table only on the server, workers pull the rows their batch touches);
* ``straggler``: the dense MLP, ``ps`` with 1 server + 3 workers, rank 2 sleeping twice its own step time after
  every step (3x slower); ``sync`` (staleness 0) against ``async`` (staleness 4). Reported: the samples/s of
  the two other workers, and of the slow one.

Per subject: ``step ms`` (worker rank 0's median step, after 3 warm-up steps), ``samples/s`` over all workers,
``sent/step`` and ``received/step`` per worker (ps: measured bytes of the messages; ddp: the ring all-reduce's
2 (n-1)/n x gradient bytes each way, computed), and the peak RSS of the largest process.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import paratrain
from paratrain.testing import spawn
from paratrain.workloads.recommender import Recommender
from paratrain.workloads.synthetic import mlp

ROWS, DIM, IDS = 1_000_000, 32, 8


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return mlp()


def _recommender() -> nn.Module:
    torch.manual_seed(0)
    return Recommender(ROWS, DIM)


def _job(workload: str, strategy: str, options: dict, steps: int, slow_rank: int | None) -> dict[str, Any] | None:
    par = paratrain.Parallel(strategy, monitor=False, **options)
    sparse = workload == "sparse"
    model = _recommender() if sparse else _mlp()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.01) if sparse else torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = par.prepare(model, opt)
    batch = 256 if sparse else 64
    g = torch.Generator().manual_seed(par.rank)
    times = []
    start = None
    for s in range(steps + 3):
        if s == 3:
            start = time.perf_counter()
        x = torch.randint(0, ROWS, (batch, IDS), generator=g) if sparse else torch.randn(batch, 784, generator=g)
        y = torch.randint(0, 2 if sparse else 10, (batch,), generator=g)
        t0 = time.perf_counter()
        with par.step(model, opt):
            par.backward(F.cross_entropy(model(x), y))
        if par.rank == slow_rank:
            time.sleep(2 * (time.perf_counter() - t0))
        times.append(time.perf_counter() - t0)
    wall = time.perf_counter() - start
    out = {
        "rank": par.rank,
        "step_ms": 1e3 * statistics.median(times[3:]),
        "samples_per_s": steps * batch / wall,
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    if strategy == "ps":
        st = par.strategy.server.worker.client.stats
        out.update(sent=st.push_bytes / st.steps, received=st.pull_bytes / st.steps)
    else:
        grad = sum(p.numel() * p.element_size() for p in par.unwrap(model).parameters())
        n = par.world_size
        out.update(sent=2 * (n - 1) / n * grad, received=2 * (n - 1) / n * grad)
    par.barrier()  # nobody leaves while another still measures (under ps: the workers)
    par.close()
    return out


SUBJECTS = {
    "dense": [("ddp", "ddp", {}, 2, None), ("ps", "ps", {"servers": 1}, 3, None)],
    "sparse": [("ddp", "ddp", {}, 2, None), ("ps", "ps", {"servers": 1, "tables": ["table"]}, 3, None)],
    "straggler": [("sync", "ps", {"servers": 1}, 4, 2), ("async", "ps", {"servers": 1, "staleness": 4}, 4, 2)],
}


def _run(workload: str, subject: tuple, steps: int) -> dict[str, Any]:
    name, strategy, options, world, slow = subject
    results = spawn(_job, world, (workload, strategy, options, steps, slow), timeout_s=600, threads=1)
    workers = [r for r in results if r is not None]
    peak = max([r["rss_mb"] for r in workers])
    fast = [r["samples_per_s"] for r in workers if r["rank"] != slow]
    return {
        "subject": name,
        "step_ms": workers[0]["step_ms"],
        "samples_per_s": sum(r["samples_per_s"] for r in workers),
        "fast_samples_per_s": statistics.mean(fast),
        "slow_samples_per_s": next((r["samples_per_s"] for r in workers if r["rank"] == slow), None),
        "sent": workers[0]["sent"],
        "received": workers[0]["received"],
        "worker_rss_mb": peak,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--which", default="dense,sparse,straggler")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--json")
    args = p.parse_args()
    rows: list[dict[str, Any]] = []
    for workload in args.which.split(","):
        for r in range(args.rounds):
            subjects = SUBJECTS[workload] if r % 2 == 0 else SUBJECTS[workload][::-1]
            for subject in subjects:
                row = {"workload": workload, "round": r, **_run(workload, subject, args.steps)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(
        f"\n{'workload':<10} {'subject':<7} {'step ms':>8} {'samples/s':>10} {'fast w. s/s':>11} {'slow w. s/s':>11} "
        f"{'sent/step':>10} {'recv/step':>10} {'worker RSS':>10}"
    )
    for workload in args.which.split(","):
        for subject in SUBJECTS[workload]:
            mine = [r for r in rows if r["workload"] == workload and r["subject"] == subject[0]]
            med = {
                k: statistics.median(r[k] for r in mine)
                for k in ("step_ms", "samples_per_s", "fast_samples_per_s", "sent", "received", "worker_rss_mb")
            }
            slow = [r["slow_samples_per_s"] for r in mine if r["slow_samples_per_s"] is not None]
            print(
                f"{workload:<10} {subject[0]:<7} {med['step_ms']:>8.1f} {med['samples_per_s']:>10.0f} "
                f"{med['fast_samples_per_s']:>11.0f} {statistics.median(slow) if slow else float('nan'):>11.0f} "
                f"{med['sent'] / 2**20:>9.2f}M {med['received'] / 2**20:>9.2f}M {med['worker_rss_mb']:>9.0f}M"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
