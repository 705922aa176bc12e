"""The losses a script logs under bf16-mixed, strategy by strategy, and zero3's step time.

nanoGPT's ``model.py`` (tests/realcode; its own ``F.cross_entropy`` inside the forward) trains 4 SGD steps on one
global batch of 8 under ``single`` (one process) and, at world 2, ``ddp``, ``zero2``, ``zero3``, ``tp`` and a
two-stage ``pipeline`` (the forward reads its input's shape: ``b, t = idx.size()``); each step's loss is
``forward_backward``'s, averaged over the replicas as a script logs it (``par.mean``). Printed: one row a strategy,
one column a step, and each row's largest distance from ddp's.

``--time``: zero3 bf16-mixed step time instead, a larger nanoGPT at world 2, the median of ``--steps`` steps after
2 warm-up steps (rank 0's clock, between barriers); run it once per tree to compare two trees, interleaved.

Run (about a minute on 2 cores):
    PYTHONPATH=src .venv/bin/python benchmarks/bf16_logged_losses.py
    PYTHONPATH=src .venv/bin/python benchmarks/bf16_logged_losses.py --time [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import paratrain

REALCODE = Path(__file__).resolve().parents[1] / "tests" / "realcode"
STEPS, GLOBAL_BATCH, SEQ, VOCAB = 4, 8, 32, 256
STRATEGIES = (("single", 1), ("ddp", 2), ("zero2", 2), ("zero3", 2), ("tp", 2), ("pipeline", 2))


def nanogpt(n_layer: int, n_embd: int, seq: int) -> torch.nn.Module:
    sys.path.insert(0, str(REALCODE))
    from nanogpt_model import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=seq, vocab_size=VOCAB, n_layer=n_layer, n_head=2, n_embd=n_embd, dropout=0.0))


def batch(seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, seq + 1), generator=torch.Generator().manual_seed(0))
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def logged(strategy: str) -> list[float] | str:
    """The replicas' mean loss at each step, or the refusal's line."""
    torch.set_num_threads(1)
    par = paratrain.Parallel(strategy, precision="bf16-mixed", monitor=False)
    try:
        model = nanogpt(2, 64, SEQ)
        model, opt = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))
        x, y = batch(SEQ)
        size, rank = par.data_parallel_size, par.data_parallel_rank
        rows = slice(rank * GLOBAL_BATCH // size, (rank + 1) * GLOBAL_BATCH // size)
        out = []
        for _ in range(STEPS):
            with par.step(model, opt):
                loss = par.forward_backward(model, x[rows].to(par.device), y[rows].to(par.device))
            out.append(float(par.mean(loss)))
        return out
    except paratrain.ParatrainError as err:
        return str(err).splitlines()[0]
    finally:
        par.close()


def step_times(steps: int) -> list[float]:
    """zero3 bf16-mixed: rank 0's seconds a step, after 2 warm-up steps."""
    torch.set_num_threads(1)
    par = paratrain.Parallel("zero3", precision="bf16-mixed", monitor=False)
    model = nanogpt(4, 256, 128)
    model, opt = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = batch(128)
    mine = slice(par.data_parallel_rank * 4, (par.data_parallel_rank + 1) * 4)
    times = []
    for s in range(steps + 2):
        dist.barrier()
        start = time.perf_counter()
        with par.step(model, opt):
            par.forward_backward(model, x[mine], y[mine])
        dist.barrier()
        if s >= 2:
            times.append(time.perf_counter() - start)
    par.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time", action="store_true", help="zero3 bf16-mixed step time instead of the losses")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    if args.time:
        times = paratrain.launch(step_times, 2, args=(args.steps,), timeout_s=600)[0]
        print(f"zero3 bf16-mixed step: median {statistics.median(times) * 1e3:.1f} ms over {len(times)} steps")
        return
    rows = {s: paratrain.launch(logged, world, args=(s,), timeout_s=300)[0] for s, world in STRATEGIES}
    print(f"{'strategy':<10}" + "".join(f"{f'step {s}':>12}" for s in range(STEPS)) + f"{'max |- ddp|':>14}")
    for name, losses in rows.items():
        if isinstance(losses, str):
            print(f"{name:<10}  refused: {losses}")
            continue
        far = max(abs(a - b) for a, b in zip(losses, rows["ddp"]))
        print(f"{name:<10}" + "".join(f"{v:>12.6f}" for v in losses) + f"{far:>14.2e}")


if __name__ == "__main__":
    main()
