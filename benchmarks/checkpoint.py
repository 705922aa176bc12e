"""Checkpoint cost and failure recovery, measured.

1. Save and load of a 100M-parameter MLP (6 x Linear(4096, 4096)) with Adam state, world 2, CPU/gloo, each
   timed between barriers (the slowest rank), median of ``--rounds``:
   * ``ddp`` + ``par.save``/``par.load``: torch.distributed.checkpoint, the replicated state written once, its
     tensors split between the ranks;
   * ``zero3`` + ``par.save``/``par.load``: each rank writes and reads its own shard;
   * ``ddp`` single file: rank 0 ``torch.save`` of the full model and optimizer state dicts (fsynced, as
     ``par.save``'s files are), every rank ``torch.load(weights_only=True)`` + ``load_state_dict`` (the
     classic full checkpoint, for comparison).
2. Death to exit: ``paratrain demo -n 2 --epochs 1 --fail-at-step 3 --fail-rank 1`` (rank 1 SIGKILLs itself, no
   restarts), from the moment rank 1 announces the kill to the launcher's exit, median of ``--deaths``; and the
   workers still alive afterwards (must be 0).
3. Restarts: the same demo with ``--checkpoint-dir --checkpoint-every 4 --max-restarts 1 --fail-at-step 10``:
   how many of ``--restarts`` jobs complete with the same final SHA-256 as an uninterrupted run, and the time
   from the kill to rank 0's "resumed from" line.

Run (about 3-5 minutes on 2 cores; --quick: a 4M-parameter model, one round each, about a minute):
    .venv/bin/python benchmarks/checkpoint.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from checkpoint_jobs import save_load_worker
from ddp_overhead import audited, background_line, kill_tree

import paratrain
from paratrain.testing import alive, child_pids

DEMO = [sys.executable, "-m", "paratrain", "demo", "-n", "2", "--epochs", "1"]
JOB_TIMEOUT_S = 300


def bench_save_load(width: int, layers: int, rounds: int) -> dict:
    out = {}
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-", dir=".") as root:
        for strategy in ("ddp", "zero3"):
            ranks = paratrain.launch(save_load_worker, 2, args=(strategy, width, layers, root, rounds), timeout_s=1800)
            out["parameters"] = ranks[0]["parameters"]
            for way, rows in ranks[0].items():
                if way != "parameters":
                    out[f"{strategy}, {way}"] = rows
    return out


def watch(cmd: list[str]) -> dict:
    """Run ``cmd``; time-stamp its fault-injection line, its "resumed from" line and its exit."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: dict = {"start": time.monotonic(), "out": [], "err": []}

    def read(stream, name: str) -> None:
        for line in stream:
            now = time.monotonic()
            if "fault injection" in line and "killed" not in seen:
                seen["killed"], seen["workers"] = now, child_pids(proc.pid)
            if "resumed from" in line and "resumed" not in seen:
                seen["resumed"] = now
            seen[name].append(line)

    readers = [
        threading.Thread(target=read, args=(proc.stdout, "out")),
        threading.Thread(target=read, args=(proc.stderr, "err")),
    ]
    for t in readers:
        t.start()
    try:
        proc.wait(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        proc.wait()
    seen["exit"] = time.monotonic()
    for t in readers:
        t.join(timeout=10)
    seen["returncode"] = proc.returncode
    seen["out"], seen["err"] = "".join(seen["out"]), "".join(seen["err"])
    return seen


def digest(text: str) -> str | None:
    found = re.search(r"sha256 ([0-9a-f]{64})", text)
    return found.group(1) if found else None


def bench_deaths(n: int) -> dict:
    times, left, named = [], [], 0
    for _ in range(n):
        job = watch([*DEMO, "--fail-at-step", "3", "--fail-rank", "1"])
        if "killed" not in job:
            raise RuntimeError(f"the fault was not injected:\n{job['err'][-2000:]}")
        times.append(job["exit"] - job["killed"])
        left.append(len(alive(job["workers"])))
        named += "paratrain: rank 1 failed" in job["err"]
    return {
        "death_to_exit_s": times,
        "median_s": statistics.median(times),
        "workers_left": left,
        "reports_naming_rank_1": named,
    }


def bench_restarts(n: int) -> dict:
    clean = digest(watch(DEMO)["out"])
    ok, resume_s, codes = 0, [], []
    for _ in range(n):
        with tempfile.TemporaryDirectory(prefix="ckpt-restart-") as ckpt:
            job = watch(
                [
                    *DEMO,
                    "--checkpoint-dir",
                    ckpt,
                    "--checkpoint-every",
                    "4",
                    "--max-restarts",
                    "1",
                    "--fail-at-step",
                    "10",
                    "--fail-rank",
                    "1",
                ]
            )
        codes.append(job["returncode"])
        ok += job["returncode"] == 0 and digest(job["out"]) == clean
        if "killed" in job and "resumed" in job:
            resume_s.append(job["resumed"] - job["killed"])
    return {
        "jobs": n,
        "completed_bitwise_equal": ok,
        "returncodes": codes,
        "death_to_resumed_s": resume_s,
        "median_death_to_resumed_s": statistics.median(resume_s) if resume_s else None,
    }


def format_report(cfg: dict, sl: dict, deaths: dict, restarts: dict) -> str:
    lines = [
        f"paratrain {paratrain.__version__}; MLP {cfg['layers']} x Linear({cfg['width']}, {cfg['width']}) = "
        f"{sl['parameters'] / 1e6:.1f}M parameters, Adam; world 2, gloo; rounds={cfg['rounds']}",
        "",
        "1. Save and load (median seconds, slowest rank; bytes on disk)",
        f"   {'way':<26}{'save s':>9}{'load s':>9}{'MB':>9}{'save MB/s':>11}",
    ]
    for way, rows in sl.items():
        if way in ("parameters", "background_share", "wall_s"):
            continue
        save, load, size = statistics.median(rows["save_s"]), statistics.median(rows["load_s"]), rows["bytes"][0]
        lines.append(f"   {way:<26}{save:>9.2f}{load:>9.2f}{size / 1e6:>9.0f}{size / 1e6 / save:>11.0f}")
    lines += [
        background_line(sl),
        "",
        f"2. Death to exit, no restarts ({len(deaths['death_to_exit_s'])} jobs): median "
        f"{deaths['median_s']:.2f} s  (each: {', '.join(f'{t:.2f}' for t in deaths['death_to_exit_s'])}); "
        f"workers left: {sum(deaths['workers_left'])}; reports naming rank 1: {deaths['reports_naming_rank_1']}",
        background_line(deaths),
        "",
        f"3. Restarts: {restarts['completed_bitwise_equal']}/{restarts['jobs']} jobs killed at step 10 completed "
        f"with the uninterrupted run's SHA-256; death to resumed: "
        + (f"median {restarts['median_death_to_resumed_s']:.2f} s" if restarts["death_to_resumed_s"] else "n/a"),
        background_line(restarts),
    ]
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a 4M-parameter model and one job of each kind")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--deaths", type=int, default=5)
    p.add_argument("--restarts", type=int, default=5)
    p.add_argument("--json", type=Path, default=None, help="also write every measurement here")
    return p.parse_args()


def main() -> None:
    a = parse_args()
    cfg = {"width": 4096, "layers": 6, "rounds": a.rounds}
    if a.quick:
        cfg = {"width": 1024, "layers": 4, "rounds": 1}
        a.deaths = a.restarts = 1
    sl = audited(lambda: bench_save_load(cfg["width"], cfg["layers"], cfg["rounds"]))
    deaths = audited(lambda: bench_deaths(a.deaths))
    restarts = audited(lambda: bench_restarts(a.restarts))
    print(format_report(cfg, sl, deaths, restarts))
    if a.json:
        a.json.write_text(
            json.dumps({"config": cfg, "save_load": sl, "deaths": deaths, "restarts": restarts}, indent=1, default=str)
        )


if __name__ == "__main__":
    main()
