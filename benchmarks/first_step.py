"""One paratrain DDP training step; each rank then writes the wall-clock time (``time.time()``) it finished.

Started by ``ddp_overhead.py`` under both ``paratrain run -n 2`` and ``torchrun --nproc-per-node 2``:
    first_step.py OUT_DIR      ->  OUT_DIR/rank{RANK}.txt
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

import paratrain
from paratrain.workloads import get_workload


def main(out_dir: Path) -> None:
    with paratrain.Parallel("ddp") as par:
        mlp = get_workload("mlp")
        torch.manual_seed(0)
        model = mlp.model()
        model, opt = par.prepare(model, mlp.optimizer(model.parameters()))
        x, y = mlp.make_batch(64, torch.Generator().manual_seed(par.rank))
        with par.step(model, opt):
            par.backward(mlp.loss(model(x), y))
        done = time.time()
        (out_dir / f"rank{par.rank}.txt").write_text(repr(done))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
