"""How often a finished job is reported failed (or hangs) at exit: ``paratrain run`` against plain torchrun.

Runs ``tests/scripts/exit_job.py`` (a few gloo DDP steps, then return) ``--runs`` times per launcher and ending
(``none``: no ``destroy_process_group``; ``destroy``: the script calls it; ``trainer``: transformers' ``Trainer`` on a
tiny GPT-2 instead, ``tests/clients/hf_trainer.py``), one job at a time, each with a hard
timeout (a job past it counts as a hang and its process group is killed). A run fails when the launcher exits
non-zero; ``abort`` counts runs whose output shows gloo's exit abort or a fatal signal.

    PYTHONPATH=src .venv/bin/python benchmarks/exit_rates.py --runs 20 --json /tmp/exit-rates.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "exit_job.py"
TRAINER = ROOT / "tests" / "clients" / "hf_trainer.py"
_ABORT = ("terminate called", "SIGABRT", "SIGSEGV", "Fatal Python error", "Signal 6", "Signal 11")


def launcher_cmd(name: str) -> list[str]:
    if name == "paratrain":
        return [sys.executable, "-m", "paratrain", "run", "-n", "2"]
    torchrun = Path(sys.executable).with_name("torchrun")
    return [str(torchrun), "--nproc-per-node", "2", "--standalone"]


def one_run(launcher: str, end: str, timeout_s: float) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as out_dir:
        script = [str(TRAINER), out_dir] if end == "trainer" else [str(SCRIPT), "--end", end]
        return _timed([*launcher_cmd(launcher), *script], timeout_s)


def _timed(cmd: list[str], timeout_s: float) -> dict[str, object]:
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        hang = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        hang = True
    seconds = time.monotonic() - start
    abort = any(marker in out for marker in _ABORT)
    return {
        "rc": proc.returncode,
        "hang": hang,
        "abort": abort,
        "seconds": round(seconds, 2),
        "tail": out.strip().splitlines()[-3:] if (proc.returncode or abort or hang) else [],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds before a job counts as a hang")
    parser.add_argument("--launchers", default="paratrain,torchrun")
    parser.add_argument("--ends", default="none,destroy")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results: dict[str, list[dict[str, object]]] = {}
    launchers, ends = args.launchers.split(","), args.ends.split(",")
    for i in range(args.runs):  # interleaved, so both launchers see the same machine load
        for end in ends:
            for launcher in launchers:
                results.setdefault(f"{launcher} {end}", []).append(one_run(launcher, end, args.timeout))
        print(f"round {i + 1}/{args.runs} done", file=sys.stderr, flush=True)
    print(f"{'launcher, ending':<22} {'runs':>5} {'failed':>7} {'aborts':>7} {'hangs':>6} {'median s':>9}")
    for key, rows in results.items():
        secs = sorted(float(r["seconds"]) for r in rows)  # type: ignore[arg-type]
        failed = sum(1 for r in rows if r["rc"] != 0)
        print(
            f"{key:<22} {len(rows):>5} {failed:>7} {sum(bool(r['abort']) for r in rows):>7} "
            f"{sum(bool(r['hang']) for r in rows):>6} {secs[len(secs) // 2]:>9.2f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
