"""Asynchronous parameter servers with workers that die: a small regression trained by ``Parallel("ps",
staleness=4)``, with chosen workers SIGKILLed after chosen steps (their first process only).

Usage: paratrain run -n 4 [--max-restarts K] ps_async_leave.py OUT_DIR RANK:STEP[,RANK:STEP...]

Every process (a replacement too) writes ``OUT_DIR/pid-<rank>-<n>`` with its pid as it starts (n: its
``PARATRAIN_REJOIN``), and every worker process that finishes writes ``OUT_DIR/worker-<rank>-<n>.json``: the step
it started at, the step it ended at, the batches it trained, the version of the parameters it first pulled, and
the final parameters (rank 0: as the servers hold them at its end).
"""
import json
import os
import signal
import sys
import time

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import paratrain
from paratrain.launch.leaving import rejoin_count

EPOCHS, BATCHES, BATCH = 3, 10, 8  # per worker: 10 batches of 8 an epoch, 30 steps


def main() -> None:
    out, kills = sys.argv[1], dict(item.split(":") for item in sys.argv[2].split(",") if item)
    rank, n = int(os.environ["RANK"]), rejoin_count()
    with open(os.path.join(out, f"pid-{rank}-{n}"), "w") as f:
        f.write(str(os.getpid()))
    torch.manual_seed(0)
    x = torch.randn(3 * BATCHES * BATCH, 6)
    y = x @ torch.randn(6, 3) + 0.1 * torch.randn(len(x), 3)
    with paratrain.Parallel("ps", servers=1, staleness=4, seed=0, monitor=False) as par:
        model = torch.nn.Linear(6, 3)
        model, opt = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
        pulled_version = list(par.strategy.worker.client.versions)
        loader = par.prepare(DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True))
        start, trained = None, 0
        for epoch in par.epochs(EPOCHS):
            for xb, yb in loader:
                start = par.optimizer_steps if start is None else start
                with par.step(model, opt):
                    loss = par.forward_backward(model, xb, yb, F.mse_loss)
                trained += 1
                time.sleep(0.02)
                if n == 0 and int(kills.get(str(rank), -1)) == par.optimizer_steps:
                    print(f"ps_async_leave: SIGKILL rank {rank} after step {par.optimizer_steps}", file=sys.stderr,
                          flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
            par.print(f"epoch {epoch} loss {par.mean(loss):.4f}")
        state = par.full_state_dict(model, rank0_only=False)
        result = {"start": start, "end": par.optimizer_steps, "trained": trained, "pulled_version": pulled_version,
                  "state": {k: v.tolist() for k, v in state.items()}}
    with open(os.path.join(out, f"worker-{rank}-{n}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
