"""What paratrain's DDP costs over hand-written torch DDP on CPU/gloo at world size 2, measured side by side.

1. Step time: one job of 2 processes holds a ``Parallel("ddp")``-prepared MLP and a raw ``DistributedDataParallel``
   MLP on one shared gloo group; timed blocks (warm-up, barrier, N steps timed one by one with
   ``time.perf_counter``) alternate between them, the order flipped every round. Rank 0's times are reported.
2. Launch to first step: ``paratrain run -n 2 first_step.py`` vs ``torchrun --nproc-per-node 2 first_step.py``
   (same script, default single-node rendezvous, OMP_NUM_THREADS=1 for both), alternating which goes first;
   from ``time.time()`` just before the launcher starts to the last rank's ``time.time()`` after its first step.
   A job that does not exit within 120 s after that is killed and counted as hung.
3. Scaling on a fixed global batch of 128: 1 process x 1 thread, 2 processes x 1 thread (DDP), and
   1 process x 2 threads, each a fresh ``paratrain.launch`` job per round, order rotated every round.

Each part also reports the share of the machine that other processes used while it ran (machine CPU time from
/proc/stat minus this process tree's own); above 5% the part is flagged, since 2 busy cores skew everything.

Run (about 2-3 minutes on 2 cores):
    cd /work/main && .venv/bin/python benchmarks/ddp_overhead.py [--rounds 5] [--steps 50] [--quick] [--json PATH]
To measure one commit while ``src/`` is being edited, put a frozen copy first on the path:
    git archive COMMIT src | tar -x -C /tmp/pt && PYTHONPATH=/tmp/pt/src .venv/bin/python benchmarks/ddp_overhead.py
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

import paratrain
from ddp_workers import step_time_worker, throughput_worker

HERE = Path(__file__).resolve().parent
CORES = len(os.sched_getaffinity(0))
BATCH_PER_RANK = 64
GLOBAL_BATCH = 128
STEP_TARGET = 1.01
LAUNCH_TARGET = 1.0
JOB_TIMEOUT_S = 120
SCALING = {"1 proc x 1 thread": (1, 1), "2 procs x 1 thread (DDP)": (2, 1), "1 proc x 2 threads": (1, 2)}


def median_ms(seconds: list[float]) -> float:
    return 1000 * statistics.median(seconds)


# ----------------------------------------------------------------------------------------------- background load
def machine_cpu_s() -> float:
    """CPU seconds every process on this machine has used since boot (from /proc/stat)."""
    user, nice, system, _idle, _iowait, irq, softirq = map(int, Path("/proc/stat").read_text().split()[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process and every descendant it has reaped (launchers, their workers)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def audited(bench: Callable[[], dict]) -> dict:
    """Run ``bench`` and add ``background_share``: the fraction of the machine other processes used meanwhile."""
    machine0, own0, t0 = machine_cpu_s(), own_cpu_s(), time.perf_counter()
    result = bench()
    foreign = (machine_cpu_s() - machine0) - (own_cpu_s() - own0)
    wall = time.perf_counter() - t0
    return {**result, "wall_s": wall, "background_share": max(0.0, foreign) / (wall * CORES)}


# ----------------------------------------------------------------------------------------------- 1. step time
def bench_step_time(rounds: int, warmup: int, steps: int) -> dict:
    ranks = paratrain.launch(step_time_worker, 2, args=(rounds, warmup, steps, BATCH_PER_RANK), threads=1,
                             timeout_s=900)
    for name in ("paratrain", "torch"):
        sums = {r["checksums"][name] for r in ranks}
        if len(sums) != 1:
            raise RuntimeError(f"{name} model differs across ranks ({sums}): gradients were not synchronised")
    times = ranks[0]["times"]
    per_round = {name: [median_ms(block) for block in blocks] for name, blocks in times.items()}
    overall = {name: median_ms([t for block in blocks for t in block]) for name, blocks in times.items()}
    paired = statistics.median(p / t for p, t in zip(per_round["paratrain"], per_round["torch"]))
    return {"per_round_ms": per_round, "median_ms": overall, "ratio": overall["paratrain"] / overall["torch"],
            "median_round_ratio": paired,
            "max_param_diff": max(r["max_param_diff"] for r in ranks), "rank_times_s": [r["times"] for r in ranks]}


# ----------------------------------------------------------------------------------------------- 2. launch
def launch_commands(out_dir: Path) -> dict[str, list[str]]:
    bindir = Path(sys.executable).parent
    script = str(HERE / "first_step.py")
    return {"paratrain run": [str(bindir / "paratrain"), "run", "-n", "2", script, str(out_dir)],
            "torchrun": [str(bindir / "torchrun"), "--nproc-per-node", "2", script, str(out_dir)]}


def time_first_step(name: str) -> tuple[float, float | None]:
    """(seconds to the last rank's first finished step, seconds until the launcher exited).

    A job that records both first steps but then does not exit within ``JOB_TIMEOUT_S`` is killed with its
    workers and reported as hung (exit time None); any other failure stops the benchmark.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="ddp-overhead-") as tmp:
        cmd = launch_commands(Path(tmp))[name]
        log = Path(tmp) / "launcher.log"
        with log.open("w") as err:
            t0 = time.time()
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)
            try:
                proc.wait(timeout=JOB_TIMEOUT_S)
                exited: float | None = time.time() - t0
            except subprocess.TimeoutExpired:
                kill_tree(proc.pid)
                proc.wait()
                exited = None
        stamps = [float(p.read_text()) for p in Path(tmp).glob("rank*.txt")]
        if len(stamps) != 2 or (exited is not None and proc.returncode != 0):
            raise RuntimeError(f"{' '.join(cmd)}: exit code {proc.returncode}, {len(stamps)} of 2 first steps "
                               f"recorded:\n{log.read_text()[-3000:]}")
    return max(stamps) - t0, exited


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and all its descendants (torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    tree, i = [pid], 0
    while i < len(tree):
        tree += children.get(tree[i], [])
        i += 1
    for p in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def bench_launch(rounds: int) -> dict:
    names = list(launch_commands(Path()))
    first: dict[str, list[float]] = {n: [] for n in names}
    exit_: dict[str, list[float | None]] = {n: [] for n in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            t_first, t_exit = time_first_step(name)
            first[name].append(t_first)
            exit_[name].append(t_exit)
    med = {n: statistics.median(v) for n, v in first.items()}
    exited = {n: [t for t in v if t is not None] for n, v in exit_.items()}
    return {"first_step_s": first, "exit_s": exit_, "median_first_step_s": med,
            "median_exit_s": {n: statistics.median(v) if v else math.nan for n, v in exited.items()},
            "hung_at_exit": {n: v.count(None) for n, v in exit_.items()},
            "ratio": med["paratrain run"] / med["torchrun"]}


# ----------------------------------------------------------------------------------------------- 3. scaling
def bench_scaling(rounds: int, warmup: int, steps: int) -> dict:
    names = list(SCALING)
    elapsed: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            nprocs, threads = SCALING[name]
            strategy = "ddp" if nprocs > 1 else "single"
            out = paratrain.launch(throughput_worker, nprocs, args=(strategy, GLOBAL_BATCH, warmup, steps),
                                   threads=threads, timeout_s=300)
            elapsed[name].append(out[0])
    med = {n: statistics.median(v) for n, v in elapsed.items()}
    base = med[names[0]]
    return {"elapsed_s": elapsed, "median_elapsed_s": med,
            "samples_per_s": {n: GLOBAL_BATCH * steps / t for n, t in med.items()},
            "speedup": {n: base / t for n, t in med.items()}}


# ----------------------------------------------------------------------------------------------- report
def verdict(ratio: float, target: float) -> str:
    return f"target <= {target:.2f}: {'met' if ratio <= target else 'MISSED'}"


def background_line(result: dict) -> str:
    share = result["background_share"]
    note = "  ** machine was not idle: numbers are suspect **" if share > 0.05 else ""
    return (f"   other processes used {100 * share:.1f}% of the {CORES} cores during this part "
            f"({result['wall_s']:.0f} s){note}")


def format_step(step: dict) -> list[str]:
    rounds, m = step["per_round_ms"], step["median_ms"]
    lines = [f"1. Step time, world 2, batch {BATCH_PER_RANK}/rank, 1 thread/rank (rank 0, ms per step)",
             f"   {'round':<8}{'paratrain':>11}{'torch':>11}{'ratio':>9}"]
    for i, (p, t) in enumerate(zip(rounds["paratrain"], rounds["torch"]), 1):
        lines.append(f"   {i:<8}{p:>11.2f}{t:>11.2f}{p / t:>9.3f}")
    return [*lines,
            f"   {'median':<8}{m['paratrain']:>11.2f}{m['torch']:>11.2f}{step['ratio']:>9.3f}   "
            f"({verdict(step['ratio'], STEP_TARGET)})",
            f"   median of the per-round ratios: {step['median_round_ratio']:.3f}",
            f"   paratrain vs torch parameters after training: max |diff| = {step['max_param_diff']:.3g}; "
            "each model identical on both ranks",
            background_line(step)]


def format_launch(launch: dict) -> list[str]:
    first, mf, me, hung = (launch[k] for k in ("first_step_s", "median_first_step_s", "median_exit_s", "hung_at_exit"))
    lines = ["2. Launch to first step, 2 processes, OMP_NUM_THREADS=1 (seconds)",
             f"   {'round':<8}{'paratrain run':>15}{'torchrun':>11}"]
    for i, (p, t) in enumerate(zip(first["paratrain run"], first["torchrun"]), 1):
        lines.append(f"   {i:<8}{p:>15.3f}{t:>11.3f}")
    return [*lines,
            f"   {'median':<8}{mf['paratrain run']:>15.3f}{mf['torchrun']:>11.3f}   ratio {launch['ratio']:.3f} "
            f"({verdict(launch['ratio'], LAUNCH_TARGET)})",
            f"   {'to exit':<8}{me['paratrain run']:>15.3f}{me['torchrun']:>11.3f}   (median, launcher start to exit)",
            f"   {'hung':<8}{hung['paratrain run']:>15}{hung['torchrun']:>11}   (jobs that recorded their first step "
            f"but did not exit within {JOB_TIMEOUT_S} s; killed)",
            background_line(launch)]


def format_scaling(scaling: dict, cfg: dict) -> list[str]:
    lines = [f"3. Scaling, fixed global batch {GLOBAL_BATCH}, {cfg['steps']} steps (median of {cfg['rounds']} jobs)",
             f"   {'config':<28}{'time s':>9}{'samples/s':>11}{'speedup':>9}{'efficiency':>12}"]
    for name, (nprocs, threads) in SCALING.items():
        t, sp = scaling["median_elapsed_s"][name], scaling["speedup"][name]
        lines.append(f"   {name:<28}{t:>9.3f}{scaling['samples_per_s'][name]:>11.0f}{sp:>8.2f}x"
                     f"{sp / (nprocs * threads):>12.2f}")
    return [*lines, background_line(scaling)]


def format_report(cfg: dict, step: dict, launch: dict, scaling: dict) -> str:
    header = [f"paratrain {paratrain.__version__} from {cfg['paratrain']}, torch {torch.__version__}, "
              f"{CORES} cores, gloo",
              f"MLP 784-1024-1024-10, SGD; rounds={cfg['rounds']} warmup={cfg['warmup']} steps={cfg['steps']}"]
    sections = [header, format_step(step), format_launch(launch), format_scaling(scaling, cfg)]
    return "\n\n".join("\n".join(lines) for lines in sections)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per benchmark (default 5)")
    p.add_argument("--steps", type=int, default=50, help="timed steps per block / scaling job (default 50)")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps before each block (default 10)")
    p.add_argument("--quick", action="store_true", help="smoke test: 2 rounds, 10 steps, 3 warm-up steps")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write every measurement here as JSON")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 10, 3
    return args


def main() -> None:
    args = parse_args()
    cfg = {"rounds": args.rounds, "steps": args.steps, "warmup": args.warmup,
           "paratrain": str(Path(paratrain.__file__).parent)}
    t0 = time.perf_counter()
    step = audited(lambda: bench_step_time(args.rounds, args.warmup, args.steps))
    launch = audited(lambda: bench_launch(args.rounds))
    scaling = audited(lambda: bench_scaling(args.rounds, args.warmup, args.steps))
    print(format_report(cfg, step, launch, scaling))
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")
    if args.json:
        meta = {"torch": torch.__version__, "cores": CORES, **cfg}
        args.json.write_text(json.dumps({"config": meta, "step_time": step, "launch": launch, "scaling": scaling},
                                        indent=1))


if __name__ == "__main__":
    main()
