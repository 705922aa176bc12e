"""The job ``porting_overhead.py`` launches: nanoGPT's training step written by hand on torch DDP (its own
``train.py``: ``DDP(model)``, ``require_backward_grad_sync`` toggled per micro-step, the loss divided by hand,
``clip_grad_norm_``) against the same step ported to ``Parallel`` (docs/porting.md), timed in alternating blocks
inside one job so both meet the same machine; and, under zero3, evaluation forwards (the ranks meet before each one
outside ``par.step``) against hand-written FSDP2 ones.

``paratrain run -n 2 benchmarks/porting_job.py OUT.json ROUNDS STEPS``: rank 0 writes every block's per-step
times. Every block starts from the same seeded weights and batches.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import paratrain

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "realcode"))
from nanogpt_model import GPT, GPTConfig  # noqa: E402

CONFIG = dict(block_size=128, vocab_size=65, n_layer=4, n_head=4, n_embd=128, dropout=0.0, bias=False)
MICRO, ACCUMULATE, EVAL_FORWARDS, WARMUP = 8, 2, 10, 3


def batches(steps: int, rank: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, CONFIG["vocab_size"], (ACCUMULATE, MICRO, CONFIG["block_size"] + 1), generator=g)
        out.append([(m[:, :-1].contiguous(), m[:, 1:].contiguous()) for m in ids])
    return out


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1337)
    model = GPT(GPTConfig(**CONFIG))
    return model, model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), "cpu")


def timed(step, work) -> list[float]:
    out = []
    for i, item in enumerate(work):
        dist.barrier()
        t0 = time.perf_counter()
        step(item)
        if i >= WARMUP:
            out.append(time.perf_counter() - t0)
    return out


def by_hand(work) -> list[float]:
    """nanoGPT's own loop on torch DDP."""
    model, optimizer = model_and_optimizer()
    model = DDP(model)

    def step(micro_batches):
        for k, (X, Y) in enumerate(micro_batches):
            model.require_backward_grad_sync = k == ACCUMULATE - 1
            _, loss = model(X, Y)
            (loss / ACCUMULATE).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return timed(step, work)


def ported(work, in_forward_backward: bool) -> list[float]:
    """The port: ``Parallel("ddp")``, the loss the model computes, accumulation and clipping by paratrain."""
    par = paratrain.Parallel("ddp", accumulate=ACCUMULATE, clip_grad_norm=1.0, monitor=False)
    model, optimizer = par.prepare(*model_and_optimizer())

    def step(micro_batches):
        for X, Y in micro_batches:
            with par.step(model, optimizer):
                if in_forward_backward:
                    par.forward_backward(model, X, Y)
                else:
                    _, loss = model(X, Y)
                    par.backward(loss)

    try:
        return timed(step, work)
    finally:
        par.close()


def evaluation(work, by_paratrain: bool, meet: bool = True) -> list[float]:
    """Forwards outside any step under zero3: paratrain's (the ranks meet before each; ``meet=False`` turns the
    meetings off, to price them alone) or hand-written FSDP2's."""
    from torch.distributed.fsdp import fully_shard

    if by_paratrain:
        par = paratrain.Parallel("zero3", monitor=False)
        model, _ = par.prepare(*model_and_optimizer())
        par._calls.enabled = meet  # a benchmark's switch: the library offers none
    else:
        par, (model, _) = None, model_and_optimizer()
        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
    model.eval()

    def forwards(micro_batches):
        with torch.no_grad():
            for _ in range(EVAL_FORWARDS // len(micro_batches)):
                for X, Y in micro_batches:
                    model(X, Y)

    try:
        return timed(forwards, work)
    finally:
        if par is not None:
            par.close()


ARMS = {
    "ddp by hand": lambda w: by_hand(w),
    "ddp ported, forward_backward": lambda w: ported(w, True),
    "ddp ported, model(X, Y) + par.backward": lambda w: ported(w, False),
    "zero3 evaluation by hand": lambda w: evaluation(w, False),
    "zero3 evaluation ported": lambda w: evaluation(w, True),
    "zero3 evaluation ported, no meetings": lambda w: evaluation(w, True, meet=False),
}


def main(out: str, rounds: int, steps: int) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    work = batches(steps + WARMUP, dist.get_rank())
    times: dict[str, list[list[float]]] = {arm: [] for arm in ARMS}
    for r in range(rounds):
        order = list(ARMS) if r % 2 == 0 else list(reversed(ARMS))
        for arm in order:
            times[arm].append(ARMS[arm](work))
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
