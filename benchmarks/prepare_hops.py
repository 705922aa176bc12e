"""Hops from ``Parallel.prepare`` to torch's ``fully_shard``: the frames of the call chain, both ends counted, on one
fake rank of a 4-process job (the fake process group: nothing is launched, nothing trains). A measure of how many
layers a reader follows from the user's verb to the engine underneath.

    .venv/bin/python benchmarks/prepare_hops.py                                # hybrid, data="zero3" (dp=2 x pp=2)
    .venv/bin/python benchmarks/prepare_hops.py --strategy zero3
    .venv/bin/python benchmarks/prepare_hops.py --strategy hybrid --data fsdp --chain   # the frames, one a line

Model: paratrain's GPT with 4 blocks of hidden 64 (``paratrain.workloads.gpt``), on the CPU.
"""

from __future__ import annotations

import argparse
import traceback

import torch.distributed as dist
import torch.distributed.fsdp as fsdp
from torch.testing._internal.distributed.fake_pg import FakeStore

import paratrain
from paratrain.env import ClusterEnv
from paratrain.planner.transformer import GPTConfig
from paratrain.workloads.gpt import GPT


def chain(strategy: str, options: dict[str, object]) -> list[traceback.FrameSummary]:
    """The frames from ``Parallel.prepare`` to the caller of the first ``fully_shard``."""
    stacks: list[traceback.StackSummary] = []
    real = fsdp.fully_shard

    def spy(*args: object, **kwargs: object) -> object:
        stacks.append(traceback.extract_stack()[:-1])
        return real(*args, **kwargs)

    fsdp.fully_shard = spy  # apply_fsdp imports it when called
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        env = ClusterEnv(rank=0, local_rank=0, world_size=4, local_world_size=4, launched=True)
        job = paratrain.JobConfig(env=env)
        par = paratrain.Parallel(strategy, accelerator="cpu", monitor=False, job=job, **options)
        par.prepare(GPT(GPTConfig(layers=4, hidden=64, heads=4, seq_len=32, vocab=128)))
    finally:
        fsdp.fully_shard = real
        dist.destroy_process_group()
    if not stacks:
        raise SystemExit(f"{strategy} {options} never calls fully_shard")
    stack = stacks[0]
    start = max(i for i, f in enumerate(stack) if f.name == "prepare" and f.filename.endswith("parallel.py"))
    return list(stack[start:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategy", default="hybrid")
    p.add_argument("--data", default="zero3", help="hybrid's data engine (ignored by other strategies)")
    p.add_argument("--chain", action="store_true", help="print the frames")
    args = p.parse_args()
    frames = chain(args.strategy, {"data": args.data} if args.strategy == "hybrid" else {})
    if args.chain:
        for f in frames:
            print(f"  {f.filename.split('paratrain/')[-1]}:{f.lineno} {f.name}")
    print(
        f"{args.strategy}{f' data={args.data}' if args.strategy == 'hybrid' else ''}: {len(frames)} hops from "
        "Parallel.prepare to fully_shard"
    )


if __name__ == "__main__":
    main()
