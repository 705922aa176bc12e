"""The fixed cost of one parameter-server request on this host: tiny requests timed round trip, 1 worker + 1 server.

    PYTHONPATH=src .venv/bin/python benchmarks/ps_messages.py                      # about 5 s
    PYTHONPATH=src .venv/bin/python benchmarks/ps_messages.py --json benchmarks/ps-messages-2026-11-25.json

One ``paratrain.launch`` job of 2 processes, one intra-op thread each. Before ``prepare``, the two ranks time a
raw gloo ping-pong of one 64-byte header (``send`` then ``recv``, what the link's latency prices: two messages).
Then under ``Parallel("ps", servers=1)`` with a tiny model (an ``nn.EmbeddingBag`` of 1,000 x 4 rows and a
``Linear(4, 2)``: 10 dense parameters) the worker times, in interleaved repetitions, round trips of

* ``pull_dense``: a header out, a header and the 10 parameters back;
* ``pull_rows``: a header and 4 row ids out, a header and 4 rows of 4 back.

Each round trip is one request and its answer, through the real client (``Client``) and the real serving loop
(header parse, schema check, payload receive and unpack, the reply's ``isend``). Printed: medians, means and
percentiles of the round trips; the mean round trip less the ping-pong (the host work per request that the link's
latency does not price); of it, the server's own time per request (its ``busy_s``, header received to reply queued,
summed over every request it served, as it reports to ``finish``: a mean) and the rest, the worker's. The planner
takes the means (``planner/hardware.py``'s ``PS_SERVER_REQUEST_S`` and ``PS_WORKER_REQUEST_S``): a step adds its
requests up, and on a shared 2-core host the round trips have a long tail (p99 several ms).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import paratrain
from paratrain.testing import spawn

ROWS, DIM = 1000, 4


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.EmbeddingBag(ROWS, DIM, mode="sum")
        self.head = nn.Linear(DIM, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.table(ids))


def _ping_pong(rank: int, n: int) -> list[float]:
    words = torch.zeros(8, dtype=torch.int64)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(words, 1)
            dist.recv(words, 1)
        else:
            dist.recv(words, 0)
            dist.send(words, 0)
        times.append(time.perf_counter() - t0)
    return times


def _job(reps: int, per_rep: int) -> dict[str, Any] | None:
    par = paratrain.Parallel("ps", servers=1, tables=["table"], monitor=False)
    pings = _ping_pong(par.rank, reps * per_rep)
    torch.manual_seed(0)
    model = _Tiny()
    model, opt = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))  # the server serves in here
    client = par.strategy.server.worker.client
    ids = torch.tensor([3, 250, 500, 999])
    times: dict[str, list[float]] = {"pull_dense": [], "pull_rows": []}
    for r in range(reps):
        order = list(times) if r % 2 == 0 else list(times)[::-1]
        for kind in order:
            for _ in range(per_rep):
                t0 = time.perf_counter()
                client.pull_dense() if kind == "pull_dense" else client.pull_rows(0, ids)
                times[kind].append(time.perf_counter() - t0)
    loads = client.finish()
    par.close()
    served = loads[0].requests  # every request it served: the first pull and the DONE included
    return {
        "ping_pong_us": 1e6 * statistics.median(pings[per_rep:]),
        **{f"{k}_us": 1e6 * statistics.median(v) for k, v in times.items()},
        **{f"{k}_mean_us": 1e6 * statistics.mean(v) for k, v in times.items()},
        **{
            f"{k}_p10_p90_p99_us": [1e6 * sorted(v)[int(q * len(v))] for q in (0.1, 0.9, 0.99)]
            for k, v in times.items()
        },
        "server_busy_per_request_us": 1e6 * loads[0].busy_s / served,
        "server_requests": served,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=10, help="interleaved repetitions (default 10)")
    p.add_argument("--per-rep", type=int, default=100, help="requests of each kind per repetition (default 100)")
    p.add_argument("--json")
    args = p.parse_args()
    start = time.perf_counter()
    results = spawn(_job, 2, (args.reps, args.per_rep), timeout_s=300, threads=1)
    out = next(r for r in results if r is not None)
    mean_us = statistics.mean([out["pull_dense_mean_us"], out["pull_rows_mean_us"]])
    out["request_mean_less_ping_pong_us"] = mean_us - out["ping_pong_us"]
    out["worker_per_request_us"] = out["request_mean_less_ping_pong_us"] - out["server_busy_per_request_us"]
    out["seconds"] = time.perf_counter() - start
    print(json.dumps(out))
    print(
        f"\nraw gloo ping-pong (median) {out['ping_pong_us']:.0f} us; a request's round trip: pull_dense median "
        f"{out['pull_dense_us']:.0f} us, mean {out['pull_dense_mean_us']:.0f} us; pull_rows (4 rows) median "
        f"{out['pull_rows_us']:.0f} us, mean {out['pull_rows_mean_us']:.0f} us.\nPer request beyond the ping-pong "
        f"(means): {out['request_mean_less_ping_pong_us']:.0f} us, of which the server "
        f"{out['server_busy_per_request_us']:.0f} us (its busy time over the {out['server_requests']} requests it "
        f"served) and the worker {out['worker_per_request_us']:.0f} us ({out['seconds']:.1f} s in all)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
