"""What paratrain's DDP costs over hand-written torch DDP on CPU/gloo at world size 2, measured side by side.

1. Step time and scaling, one ``paratrain.bench`` run (the library behind ``paratrain bench``) of the MLP
   784-1024-1024-10 on a fixed global batch of 128, every rank 1 thread: 1 process; 2 processes with
   paratrain's ddp and a hand-written ``DistributedDataParallel`` loop, whose timed blocks alternate inside one
   job (warm-up, barrier, N steps timed one by one, the order flipped every round; each block starts from the
   same seeded weights and data, so both end with the same parameters); and 1 process x 2 threads. The
   overhead is the median over rounds of paratrain's block median over torch's (slowest rank). It is the
   same measurement as ``paratrain bench --workload mlp --nproc 1,2 --compare torch-ddp --threads
   --scaling strong --batch 128 --threads-per-rank 1``.
2. Launch to the first collective: ``paratrain run -n 2`` vs ``torchrun --nproc-per-node 2`` on the same script
   written by hand (``first_step.py --plain``: init_process_group + DDP, nothing of paratrain imported), so the
   launchers alone are compared; and ``torchrun`` on the paratrain version of the script, whose ``Parallel()`` +
   ``prepare()`` is timed against the hand-written set-up. Default single-node rendezvous, OMP_NUM_THREADS=1,
   the order alternating; from ``time.time()`` just before the launcher starts to the last rank's stamp. A job
   that does not exit within 120 s is killed and counted as hung.

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
from paratrain.bench import BenchConfig, run_bench, to_json
from paratrain.bench.machine import BackgroundLoad

HERE = Path(__file__).resolve().parent
CORES = len(os.sched_getaffinity(0))
GLOBAL_BATCH = 128
STEP_TARGET = 1.01
LAUNCH_TARGET = 1.05  # issue #13: launch to the first collective within 5% of torchrun
JOB_TIMEOUT_S = 120


# ----------------------------------------------------------------------------------------------- background load
def audited(bench: Callable[[], dict]) -> dict:
    """Run ``bench`` and add ``background_share``: the fraction of the machine other processes used meanwhile."""
    load, t0 = BackgroundLoad(), time.perf_counter()
    result = bench()
    return {**result, "wall_s": time.perf_counter() - t0, "background_share": load.share()}


# ----------------------------------------------------------------------------------------------- 1. step time, scaling
def bench_step_and_scaling(rounds: int, warmup: int, steps: int) -> dict:
    config = BenchConfig(
        workload="mlp",
        nprocs=(1, 2),
        strategies=("ddp",),
        scaling="strong",
        batch=GLOBAL_BATCH,
        compare="torch-ddp",
        threads=True,
        threads_per_rank=1,
        rounds=rounds,
        warmup=warmup,
        steps=steps,
        timeout_s=900,
    )
    result = to_json(run_bench(config))
    (comparison,) = result["comparisons"]
    if comparison["max_param_diff"] != 0.0:
        raise RuntimeError(f"paratrain and torch DDP ended with different parameters ({comparison['max_param_diff']})")
    return result


# ----------------------------------------------------------------------------------------------- 2. launch
LAUNCHES = {  # name -> (launcher, script mode)
    "paratrain run, plain script": ("paratrain run", "--plain"),
    "torchrun, plain script": ("torchrun", "--plain"),
    "torchrun, paratrain script": ("torchrun", ""),
}


def launch_command(launcher: str, mode: str, out_dir: Path) -> list[str]:
    bindir = Path(sys.executable).parent
    script = [str(HERE / "first_step.py"), str(out_dir), *([mode] if mode else [])]
    if launcher == "paratrain run":
        return [str(bindir / "paratrain"), "run", "-n", "2", *script]
    return [str(bindir / "torchrun"), "--nproc-per-node", "2", *script]


def time_first_step(name: str) -> dict[str, float | None]:
    """Seconds from the launcher's start to the last rank's first collective and first step, seconds to the
    launcher's exit, and the slowest rank's in-script set-up (``Parallel`` + ``prepare``, or its hand-written twin).

    A job that records both first steps but then does not exit within ``JOB_TIMEOUT_S`` is killed with its
    workers and reported as hung (exit time None); any other failure stops the benchmark.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="ddp-overhead-") as tmp:
        cmd = launch_command(*LAUNCHES[name], Path(tmp))
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
        ranks = [json.loads(p.read_text()) for p in Path(tmp).glob("rank*.json")]
        if len(ranks) != 2 or (exited is not None and proc.returncode != 0):
            raise RuntimeError(
                f"{' '.join(cmd)}: exit code {proc.returncode}, {len(ranks)} of 2 first steps "
                f"recorded:\n{log.read_text()[-3000:]}"
            )
    return {
        "first_collective_s": max(r["first_collective"] for r in ranks) - t0,
        "first_step_s": max(r["done"] for r in ranks) - t0,
        "exit_s": exited,
        "setup_s": max(r["setup_s"] for r in ranks),
    }


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
    """Every launch of ``LAUNCHES`` once per round, the order reversed every other round."""
    names = list(LAUNCHES)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            runs[name].append(time_first_step(name))
    med = {
        n: {
            k: statistics.median(x[k] for x in v if x[k] is not None) if any(x[k] is not None for x in v) else math.nan
            for k in v[0]
        }
        for n, v in runs.items()
    }
    return {
        "runs": runs,
        "median": med,
        "hung_at_exit": {n: sum(x["exit_s"] is None for x in v) for n, v in runs.items()},
        "ratio": med["paratrain run, plain script"]["first_collective_s"]
        / med["torchrun, plain script"]["first_collective_s"],
    }


# ----------------------------------------------------------------------------------------------- report
def verdict(ratio: float, target: float) -> str:
    return f"target <= {target:.2f}: {'met' if ratio <= target else 'MISSED'}"


def background_line(result: dict) -> str:
    share = result["background_share"]
    note = "  ** machine was not idle: numbers are suspect **" if share > 0.05 else ""
    return (
        f"   other processes used {100 * share:.1f}% of the {CORES} cores during this part "
        f"({result['wall_s']:.0f} s){note}"
    )


def format_step(bench: dict) -> list[str]:
    rows = {r["name"]: r for r in bench["rows"]}
    ours, theirs, c = rows["ddp x2"], rows["torch-ddp x2"], bench["comparisons"][0]
    lines = [
        f"1. Step time, world 2, batch {GLOBAL_BATCH // 2}/rank, 1 thread/rank (slowest rank, ms per step)",
        f"   {'round':<8}{'paratrain':>11}{'torch':>11}{'ratio':>9}",
    ]
    for i, (p, t, ratio) in enumerate(zip(ours["rounds_ms"], theirs["rounds_ms"], c["rounds"]), 1):
        lines.append(f"   {i:<8}{p:>11.2f}{t:>11.2f}{ratio:>9.3f}")
    return [
        *lines,
        f"   {'median':<8}{c['paratrain_ms']:>11.2f}{c['torch_ms']:>11.2f}{c['overhead']:>9.3f}   "
        f"(median of the per-round ratios; {verdict(c['overhead'], STEP_TARGET)})",
        f"   paratrain vs torch parameters after the same steps: max |diff| = {c['max_param_diff']:.3g}",
        f"   communication: {100 * ours['comm_share']:.0f}% of paratrain's step waits for the gradient all-reduce "
        f"(step with minus without gradient sync)",
        background_line(bench),
    ]


def format_scaling(bench: dict) -> list[str]:
    lines = [
        f"3. Scaling, fixed global batch {GLOBAL_BATCH} (median step of {bench['config']['rounds']} blocks "
        f"of {bench['config']['steps']} steps; the same run as part 1)",
        f"   {'config':<22}{'step ms':>9}{'samples/s':>11}{'speedup':>9}{'efficiency':>12}{'comm':>7}",
    ]
    for r in bench["rows"]:
        comm = "-" if r["comm_share"] is None else f"{100 * r['comm_share']:.0f}%"
        lines.append(
            f"   {r['name']:<22}{r['step_ms']:>9.2f}{r['samples_per_s']:>11.0f}{r['speedup']:>8.2f}x"
            f"{r['efficiency']:>12.2f}{comm:>7}"
        )
    return [*lines, f"   fastest: {bench['fastest']}"]


def format_launch(launch: dict) -> list[str]:
    runs, med, hung = launch["runs"], launch["median"], launch["hung_at_exit"]
    names = list(LAUNCHES)
    lines = [
        "2. Launch to the first collective, 2 processes, OMP_NUM_THREADS=1 (seconds from the launcher's start)",
        f"   {'round':<8}" + "".join(f"{n:>30}" for n in names),
    ]
    for i in range(len(runs[names[0]])):
        lines.append(f"   {i + 1:<8}" + "".join(f"{runs[n][i]['first_collective_s']:>30.3f}" for n in names))
    lines.append(f"   {'median':<8}" + "".join(f"{med[n]['first_collective_s']:>30.3f}" for n in names))
    lines.append(
        f"   paratrain run / torchrun, the same plain script: {launch['ratio']:.3f} "
        f"({verdict(launch['ratio'], LAUNCH_TARGET)})"
    )
    for key, what in (
        ("first_step_s", "to the first step"),
        ("exit_s", "to exit"),
        ("setup_s", "set-up in the script"),
    ):
        lines.append(f"   {what:<22}" + "".join(f"{med[n][key]:>24.3f}" for n in names))
    lines.append("   (set-up: Parallel() + prepare() in the paratrain script; init_process_group + DDP(model) by hand)")
    lines.append(f"   {'hung at exit':<22}" + "".join(f"{hung[n]:>24}" for n in names))
    return [*lines, background_line(launch)]


def format_report(cfg: dict, bench: dict, launch: dict) -> str:
    header = [
        f"paratrain {paratrain.__version__} from {cfg['paratrain']}, torch {torch.__version__}, {CORES} cores, gloo",
        f"MLP 784-1024-1024-10, SGD; rounds={cfg['rounds']} warmup={cfg['warmup']} steps={cfg['steps']}",
    ]
    sections = [header, format_step(bench), format_launch(launch), format_scaling(bench)]
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
    cfg = {
        "rounds": args.rounds,
        "steps": args.steps,
        "warmup": args.warmup,
        "paratrain": str(Path(paratrain.__file__).parent),
    }
    t0 = time.perf_counter()
    bench = audited(lambda: bench_step_and_scaling(args.rounds, args.warmup, args.steps))
    launch = audited(lambda: bench_launch(args.rounds))
    print(format_report(cfg, bench, launch))
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")
    if args.json:
        meta = {"torch": torch.__version__, "cores": CORES, **cfg}
        args.json.write_text(json.dumps({"config": meta, "bench": bench, "launch": launch}, indent=1))


if __name__ == "__main__":
    main()
