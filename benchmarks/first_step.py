"""One paratrain DDP training step; each rank then writes the wall-clock time (``time.time()``) it finished.

Started by ``ddp_overhead.py`` under both ``paratrain run -n 2`` and ``torchrun --nproc-per-node 2``:
    first_step.py OUT_DIR      ->  OUT_DIR/rank{RANK}.txt
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import paratrain
from ddp_workers import LR, build_mlp, make_batch


def main(out_dir: Path) -> None:
    with paratrain.Parallel("ddp") as par:
        model = build_mlp()
        model, opt = par.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
        x, y = make_batch(64, par.rank)
        with par.step(model, opt):
            par.backward(F.cross_entropy(model(x), y))
        done = time.time()
        (out_dir / f"rank{par.rank}.txt").write_text(repr(done))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
