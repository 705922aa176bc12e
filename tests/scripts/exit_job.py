"""A plain gloo DDP script that trains a few steps and returns; how it ends is the point.

Usage: torchrun --nproc-per-node 2 exit_job.py [--end none|destroy|stuck-atexit] [--crash-at-teardown] [--out DIR]

``none`` leaves the process group open (as transformers' ``Trainer`` and many scripts do), ``destroy`` calls
``destroy_process_group()``, ``stuck-atexit`` registers an atexit handler that never returns. With ``--out`` each
rank writes ``DIR/rank{RANK}.done`` when the script has returned and ``DIR/rank{RANK}.atexit`` from its atexit
handler (the stuck one writes it before it blocks), and leaves ``DIR/rank{RANK}.unclosed`` open with its text
unflushed. ``--crash-at-teardown`` makes the interpreter's finalization
abort the process (SIGABRT), as gloo's threads do at random: a stand-in that always happens.
"""

import argparse
import atexit
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def _mark(out: str | None, name: str) -> None:
    if out:
        with open(os.path.join(out, f"rank{os.environ['RANK']}.{name}"), "w") as f:
            f.write(f"{os.getpid()}\n")


class _AbortWhenFreed:
    """Kept in ``sys.modules``, which only the interpreter's finalization clears."""

    def __del__(self) -> None:
        os.abort()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--end", choices=["none", "destroy", "stuck-atexit"], default="none")
    parser.add_argument("--crash-at-teardown", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        opt.zero_grad()
        model(torch.randn(32, 64)).sum().backward()
        opt.step()
    if args.end == "destroy":
        dist.destroy_process_group()
    elif args.end == "stuck-atexit":
        atexit.register(lambda: (_mark(args.out, "atexit"), time.sleep(3600)))
    if args.end != "stuck-atexit":
        atexit.register(_mark, args.out, "atexit")
    if args.crash_at_teardown:
        sys.modules["_exit_job_abort_when_freed"] = _AbortWhenFreed()  # type: ignore[assignment]
    if args.out:  # left open and unflushed, as careless scripts do: its text must still reach the file
        log = open(os.path.join(args.out, f"rank{os.environ['RANK']}.unclosed"), "w")  # noqa: SIM115
        log.write("written\n")
    _mark(args.out, "done")
