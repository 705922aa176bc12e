"""What each rank draws after ``prepare``, for tests/test_replicas.py: ``paratrain run -n N replica_draws.py OUT``.

Each case prepares a small model under a strategy with no ``seed=`` (torch's one default seed on every rank) and
records the first ``torch.randint`` draw after ``prepare``, the ``accumulate`` a global batch gave, and then feeds
the model the same first batch on every rank, a batch of each replica's own, or one seeded with ``par.rank``
(``generate``: a forward after the step, outside it, seeded so), or (``evaluate``) one batch on every replica in an
evaluation before its own; rank 0's stderr shows what was warned.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

import paratrain

CASES = [
    ("ddp", {}, "same"),
    ("ddp", {}, "own"),
    ("tp", {"tp_plan": {"0": "colwise", "2": "rowwise"}}, "same"),
    ("tp", {"tp_plan": {"0": "colwise", "2": "rowwise"}}, "rank"),
    ("tp", {"tp_plan": {"0": "colwise", "2": "rowwise"}}, "generate"),
    ("pipeline", {}, "rank"),
    ("auto", {}, "own"),
    ("ddp", {}, "evaluate"),
]


def case(strategy: str, options: dict, batch: str) -> dict:
    par = paratrain.Parallel(strategy, monitor=False, accumulate=paratrain.GlobalBatch(16, micro=4), **options)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model, opt = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    drawn = torch.randint(0, 1 << 30, (4,)).tolist()
    seed = {"same": 0, "own": par.data_parallel_rank, "rank": par.rank}.get(batch, par.data_parallel_rank)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
    if par.rank == 0:
        print(f"case {strategy} {batch}", file=sys.stderr, flush=True)
    if batch == "evaluate":  # one batch on every replica, before training: no first step of theirs
        with torch.no_grad():
            par.map_evenly(model, [torch.ones(2, 8)])
    with par.step(model, opt):
        par.forward_backward(model, x, torch.zeros(4, dtype=torch.long), torch.nn.functional.cross_entropy)
    if strategy == "tp" and batch in ("same", "generate"):  # sampling after training: "generate" seeds by par.rank
        with torch.no_grad():
            model(torch.randn(2, 8, generator=torch.Generator().manual_seed(par.rank if batch == "generate" else 1)))
    out = {
        "drawn": par.mean(torch.tensor(drawn, dtype=torch.float64)).tolist(),
        "mine": drawn,
        "replica": par.data_parallel_rank,
        "accumulate": par.accumulate,
    }
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, out)
    par.close()
    return {"ranks": everyone}


def whole_sequences() -> None:
    """zero3 x cp=2 on a GPT called directly inside ``par.step`` with one batch on both ranks: the input is compared
    as given, before cp cuts it into each rank's slice."""
    from paratrain.workloads.gpt import GPT, GPTConfig

    par = paratrain.Parallel("zero3", cp=2, monitor=False)
    model = GPT(GPTConfig(layers=1, hidden=16, heads=2, seq_len=8, vocab=32))
    model, opt = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    if par.rank == 0:
        print("case zero3-cp same", file=sys.stderr, flush=True)
    with par.step(model, opt):
        par.backward(model(torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))).pow(2).mean())
    par.close()


def main(out: str) -> None:
    dist.init_process_group("gloo")
    results = {f"{s} {b}": case(s, o, b) for s, o, b in CASES}
    whole_sequences()
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
