"""Asynchronous parameter servers with workers that die: a small regression trained by ``Parallel("ps",
staleness=4)``, with chosen workers SIGKILLed after chosen steps (their first process only).

Usage: paratrain run -n 4 [--max-restarts K] ps_async_leave.py OUT_DIR RANK:STEP[:mid][,RANK:STEP[:mid]...]

``RANK:STEP`` kills that worker after its optimizer step STEP; ``RANK:STEP:mid`` in the middle of its next push
(its header sent, its gradients not), so that the server loses it inside a request.

Every process (a replacement too) writes ``OUT_DIR/pid-<rank>-<n>`` with its pid as it starts (n: its
``PARATRAIN_REJOIN``), and every worker process that finishes writes ``OUT_DIR/worker-<rank>-<n>.json``: the step
it started at, the step it ended at, the batches it trained, the version of the parameters it first pulled, and
the final parameters (rank 0: as the servers hold them at its end), with the wall-clock times (``time.time()``) of
its start, of its first pull's answer and of each step's end. A kill writes ``OUT_DIR/killed-<rank>`` with its
time. ``PS_ASYNC_LEAVE_SLEEP`` sets the seconds each step sleeps (default 0.02), ``PS_ASYNC_LEAVE_EPOCHS`` the
epochs (default 3).
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
from paratrain.launcher.leaving import rejoin_count

EPOCHS, BATCHES, BATCH = int(os.environ.get("PS_ASYNC_LEAVE_EPOCHS", "3")), 10, 8  # 10 batches of 8 an epoch


def main() -> None:
    out, kills = sys.argv[1], {int(item.split(":")[0]): item.split(":")[1:] for item in sys.argv[2].split(",") if item}
    rank, n = int(os.environ["RANK"]), rejoin_count()
    started = time.time()
    step, mid = (int(kills[rank][0]), kills[rank][1:] == ["mid"]) if rank in kills and n == 0 else (-1, False)
    if mid:
        die_inside_push(rank, step + 1, out)
    with open(os.path.join(out, f"pid-{rank}-{n}"), "w") as f:
        f.write(str(os.getpid()))
    torch.manual_seed(0)
    x = torch.randn(3 * BATCHES * BATCH, 6)
    y = x @ torch.randn(6, 3) + 0.1 * torch.randn(len(x), 3)
    with paratrain.Parallel("ps", servers=1, staleness=4, seed=0, monitor=False) as par:
        model = torch.nn.Linear(6, 3)
        model, opt = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
        pulled_version, pulled_at = list(par.strategy.server.worker.client.versions), time.time()
        loader = par.prepare(DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True))
        start, trained, ends = None, 0, []
        for epoch in par.epochs(EPOCHS):
            for xb, yb in loader:
                start = par.optimizer_steps if start is None else start
                with par.step(model, opt):
                    loss = par.forward_backward(model, xb, yb, F.mse_loss)
                trained += 1
                time.sleep(float(os.environ.get("PS_ASYNC_LEAVE_SLEEP", "0.02")))
                ends.append(time.time())
                if not mid and step == par.optimizer_steps:
                    die(f"SIGKILL rank {rank} after step {step}", out, rank)
            par.print(f"epoch {epoch} loss {par.mean(loss):.4f}")
        state = par.full_state_dict(model, rank0_only=False)
        result = {
            "start": start,
            "end": par.optimizer_steps,
            "trained": trained,
            "pulled_version": pulled_version,
            "state": {k: v.tolist() for k, v in state.items()},
            "started": started,
            "pulled_at": pulled_at,
            "step_ends": ends,
        }
    with open(os.path.join(out, f"worker-{rank}-{n}.json"), "w") as f:
        json.dump(result, f)


def die(what: str, out: str, rank: int) -> None:
    with open(os.path.join(out, f"killed-{rank}"), "w") as f:
        f.write(str(time.time()))
    print(f"ps_async_leave: {what}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def die_inside_push(rank: int, push: int, out: str) -> None:
    """SIGKILL this process once push number ``push``'s header is on its way and before its gradients are."""
    from paratrain.distributed.param_server import client
    from paratrain.distributed.param_server.messages import PUSH_DENSE, REQUEST_TAG

    request = client.Client._request

    def header_then_die(self, server, h, payload=None):
        if h.kind == PUSH_DENSE and self.step_no == push:
            self.peers[server].isend(h.tensor(), REQUEST_TAG).wait()
            time.sleep(0.2)
            die(f"SIGKILL rank {rank} inside push {push} (header sent, gradients not)", out, rank)
        return request(self, server, h, payload)

    client.Client._request = header_then_die


if __name__ == "__main__":
    main()
