"""What ``par.save``/``par.load`` cost under ``Parallel("ps")`` against ``Parallel("ddp")`` on CPU/gloo, on the
recommender of ``benchmarks/ps.py`` (a 1 M x 32 ``nn.EmbeddingBag``, 122 MiB, and an MLP; Adagrad, whose state is
one more table-sized tensor). ``ddp``: 2 processes, the table replicated, DCP writes one copy; ``ps``: 1 server + 2
workers, the server writes the table and its state on a SAVE message while the workers write theirs. Each job
trains 3 steps, then saves and loads ``--repeats`` times into a fresh folder; subjects take turns each round, the
order reversed every other round; medians over everything.

    .venv/bin/python benchmarks/ps_checkpoint.py --rounds 2      # RESULTS.md §16 (about 2 min here)
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from ps import IDS, ROWS, _Recommender
from torch.nn import functional as F

import paratrain
from paratrain.testing import spawn


def _job(strategy: str, options: dict, repeats: int, root: str) -> dict[str, Any] | None:
    par = paratrain.Parallel(strategy, monitor=False, **options)
    model, opt = _prepare(par)
    g = torch.Generator().manual_seed(par.rank)
    for _ in range(3):
        with par.step(model, opt):
            par.backward(
                F.cross_entropy(
                    model(torch.randint(0, ROWS, (256, IDS), generator=g)), torch.randint(0, 2, (256,), generator=g)
                )
            )
    saves, loads = [], []
    for i in range(repeats):
        par.barrier()
        t0 = time.perf_counter()
        path = par.save(Path(root) / f"{strategy}-{i}")
        saves.append(time.perf_counter() - t0)
        par.barrier()
        t0 = time.perf_counter()
        par.load(path)
        loads.append(time.perf_counter() - t0)
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    par.barrier()
    par.close()
    return {"rank": par.rank, "save_s": saves, "load_s": loads, "bytes": size}


def _prepare(par: paratrain.Parallel):
    model = _Recommender()
    return par.prepare(model, torch.optim.Adagrad(model.parameters(), lr=0.01))


SUBJECTS = [("ddp", {}, 2), ("ps", {"servers": 1, "tables": ["table"]}, 3)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json")
    args = p.parse_args()
    rows = []
    for r in range(args.rounds):
        for strategy, options, world in SUBJECTS if r % 2 == 0 else SUBJECTS[::-1]:
            root = tempfile.mkdtemp(prefix="ps-ckpt-")
            try:
                out = spawn(_job, world, (strategy, options, args.repeats, root), timeout_s=600, threads=1)[0]
            finally:
                shutil.rmtree(root, ignore_errors=True)
            row = {"subject": strategy, "round": r, **out}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'subject':<8} {'save s':>8} {'load s':>8} {'checkpoint':>11}")
    for strategy, _, _ in SUBJECTS:
        mine = [r for r in rows if r["subject"] == strategy]
        save = statistics.median(s for r in mine for s in r["save_s"])
        load = statistics.median(s for r in mine for s in r["load_s"])
        print(f"{strategy:<8} {save:>8.2f} {load:>8.2f} {mine[-1]['bytes'] / 2**20:>9.0f}Mi")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
