"""Which writer an asynchronous save should use: torch.distributed.checkpoint's thread
(``AsyncCheckpointerType.THREAD``, what paratrain uses) or its daemon process (``PROCESS``: no GIL shared with training,
at the cost of starting a process, with a process group of its own, at the first save, and staging into shared memory).

One process (a gloo group of 1), an MLP trained with Adam on one thread; both writers stage through a
``DefaultStager`` of their own (kept between saves). The first save of each writer is reported apart (the process
starts then); then rounds alternate which writer saves first. Each save is followed by steps until its write is
done. Reported per writer, medians: the training thread's hold (the save call plus the wait for the copy before the
next optimizer step), the write's duration, and the step time while it writes against steps without a save.

Run (about 2 minutes on 2 cores):
    .venv/bin/python benchmarks/checkpoint_writer.py [--rounds 6] [--width 2048] [--layers 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from checkpoint_jobs import build_mlp
from ddp_overhead import audited, background_line
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

WRITERS = {"thread": AsyncCheckpointerType.THREAD, "process": AsyncCheckpointerType.PROCESS}


def run(args: argparse.Namespace, root: str) -> dict:
    torch.set_num_threads(1)
    model = build_mlp(args.width, args.layers)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-5)
    x = torch.randn(16, args.width)
    stagers = {name: DefaultStager(StagingOptions(False, name == "process", True, False)) for name in WRITERS}
    group = dist.new_group(backend="gloo")

    def step() -> float:
        start = time.perf_counter()
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - start

    def save(name: str, folder: str) -> tuple[float, float, list[float]]:
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
        start = time.perf_counter()
        response = dcp.async_save(
            state,
            storage_writer=dcp.FileSystemWriter(folder),
            process_group=group,
            async_checkpointer_type=WRITERS[name],
            async_stager=stagers[name],
        )
        call = time.perf_counter() - start
        before = time.perf_counter()
        response.staging_completion.result()  # what the next optimizer step waits for
        held = call + time.perf_counter() - before
        steps = []
        while not response.upload_completion.done():
            steps.append(step())
        response.upload_completion.result()
        return held, time.perf_counter() - start, steps

    for _ in range(2):
        step()
    first = {name: save(name, os.path.join(root, f"first-{name}"))[:2] for name in WRITERS}
    rows: dict[str, dict[str, list]] = {name: {"held_s": [], "write_s": [], "steps_s": []} for name in WRITERS}
    quiet: list[float] = []
    for r in range(args.rounds):
        for name in list(WRITERS)[:: 1 if r % 2 == 0 else -1]:
            held, write, steps = save(name, os.path.join(root, f"{r}-{name}"))
            rows[name]["held_s"].append(held)
            rows[name]["write_s"].append(write)
            rows[name]["steps_s"] += steps
            quiet += [step() for _ in range(3)]
    for stager in stagers.values():
        stager.close()
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3
    return {"state_bytes": state_bytes, "first": first, "rows": rows, "quiet_steps_s": quiet}


def report(args: argparse.Namespace, result: dict) -> str:
    quiet = statistics.median(result["quiet_steps_s"])
    lines = [
        (
            f"one process, MLP {args.layers} x Linear({args.width}, {args.width}): state "
            f"{result['state_bytes'] / 1e6:.0f} MB (weights + Adam); median of {args.rounds} rounds; step without "
            f"a save {1e3 * quiet:.0f} ms"
        ),
        f"   {'writer':<9}{'held ms':>9}{'write s':>9}{'step while writing ms':>23}   first save: held ms, write s",
    ]
    for name in WRITERS:
        row, (held, write) = result["rows"][name], result["first"][name]
        during = statistics.median(row["steps_s"]) if row["steps_s"] else float("nan")
        lines.append(
            f"   {name:<9}{1e3 * statistics.median(row['held_s']):>9.0f}"
            f"{statistics.median(row['write_s']):>9.2f}{1e3 * during:>12.0f} ({during / quiet:.2f}x)"
            f"{'':>5}   {1e3 * held:.0f}, {write:.2f}"
        )
    return "\n".join(lines + [background_line(result)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ckpt-writer-bench-", dir=".") as root:
        dist.init_process_group("gloo", init_method=f"file://{Path(root) / 'store'}", rank=0, world_size=1)
        try:
            result = audited(lambda: run(args, root))
        finally:
            dist.destroy_process_group()
    print(report(args, result))


if __name__ == "__main__":
    main()
