"""One DDP training step, written with paratrain or by hand; each rank writes when it got where, as JSON.

Started by ``ddp_overhead.py`` under ``paratrain run -n 2`` and ``torchrun --nproc-per-node 2``:
    first_step.py OUT_DIR            ->  OUT_DIR/rank{RANK}.json  (paratrain: Parallel + prepare)
    first_step.py OUT_DIR --plain    ->  the same by hand: init_process_group + DDP, nothing of paratrain imported

Fields (``time.time()`` stamps and seconds): ``started`` (the script's first line), ``first_collective`` (the
process group's first collective done: the launch is over), ``setup_s`` (``Parallel()`` + ``prepare()``, or
``init_process_group`` + ``DDP(model)``, on a loaded ``torch``), ``done`` (the first step finished).
"""

from __future__ import annotations

import time

STARTED = time.time()

import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402


def build() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    g = torch.Generator().manual_seed(int(__import__("os").environ.get("RANK", "0")))
    return model, torch.randn(64, 784, generator=g), torch.randint(0, 10, (64,), generator=g)


def by_hand(out_dir: Path) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, x, y = build()
    start = time.perf_counter()
    dist.init_process_group("gloo")
    dist.barrier()
    first = time.time()
    model = DDP(model)
    setup = time.perf_counter() - start
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    _write(out_dir, dist.get_rank(), first, setup)
    dist.barrier()
    dist.destroy_process_group()


def with_paratrain(out_dir: Path) -> None:
    import paratrain

    model, x, y = build()
    start = time.perf_counter()
    with paratrain.Parallel("ddp", monitor=False) as par:  # its configuration check is the first collective
        first = time.time()
        model, opt = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
        setup = time.perf_counter() - start
        with par.step(model, opt):
            par.backward(nn.functional.cross_entropy(model(x), y))
        _write(out_dir, par.rank, first, setup)


def _write(out_dir: Path, rank: int, first: float, setup: float) -> None:
    record = {"started": STARTED, "first_collective": first, "setup_s": setup, "done": time.time()}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    (by_hand if "--plain" in sys.argv[2:] else with_paratrain)(Path(sys.argv[1]))
