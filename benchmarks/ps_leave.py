"""An asynchronous parameter-server worker SIGKILLed mid-training: what the others lose, how soon its rank is back.

Runs ``tests/scripts/ps_async_leave.py`` (3 workers and 1 server, ``staleness=4``, a small regression whose steps
sleep 20 ms, so that a step's time is mostly the workers' own) under ``paratrain run -n 4 --max-restarts 1``, in
interleaved rounds: a clean job, then one whose worker rank 1 is SIGKILLed after step K. From the processes' own
clocks it reports, per killed job:

* rank 0's step time: median over the whole run, and its longest step from the kill until rank 1's new process
  pulled (does a survivor stall while the servers notice the death and the launcher replaces it?);
* kill -> the new process of rank 1 starts -> its first pull is answered (the time the rank is away);
* rank 0's wall time from its first to its last step, against the clean job's of the same round.

    .venv/bin/python benchmarks/ps_leave.py --rounds 3 --json benchmarks/ps-leave-DATE.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "ps_async_leave.py"


def job(kill: str, epochs: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "PS_ASYNC_LEAVE_EPOCHS": str(epochs), "PYTHONPATH": str(ROOT / "src")}
        res = subprocess.run(
            [sys.executable, "-m", "paratrain", "run", "-n", "4", "--max-restarts", "1", str(SCRIPT), out, kill],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=ROOT,
            env=env,
        )
        if res.returncode:
            raise SystemExit(f"job {kill or 'clean'} failed:\n{res.stderr[-3000:]}")
        found = {p.name: json.loads(p.read_text()) for p in Path(out).glob("worker-*.json")}
        killed = [float(p.read_text()) for p in Path(out).glob("killed-*")]
    r0 = found["worker-0-0.json"]
    ends = r0["step_ends"]
    steps = [b - a for a, b in zip(ends, ends[1:])]
    row = {"rank0_wall_s": ends[-1] - ends[0], "rank0_step_ms_median": 1e3 * statistics.median(steps)}
    if killed:
        back = found["worker-1-1.json"]
        t = killed[0]
        window = [b - a for a, b in zip(ends, ends[1:]) if b > t and a < back["pulled_at"]]
        row.update(
            kill_to_start_s=back["started"] - t,
            kill_to_pull_s=back["pulled_at"] - t,
            rank0_longest_step_ms_while_away=1e3 * max(window, default=0.0),
            rank0_steps_while_away=len(window),
            back_start=back["start"],
        )
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=20, help="epochs of 10 steps per worker (default 20)")
    p.add_argument("--kill-step", type=int, default=40)
    p.add_argument("--json", help="write every round's figures here")
    args = p.parse_args()
    rounds = []
    for i in range(args.rounds):
        clean, killed = job("", args.epochs), job(f"1:{args.kill_step}", args.epochs)
        rounds.append({"clean": clean, "killed": killed})
        print(
            f"round {i + 1}: clean rank 0 {clean['rank0_wall_s']:.2f} s (step {clean['rank0_step_ms_median']:.1f} ms)"
            f"; killed rank 0 {killed['rank0_wall_s']:.2f} s (step {killed['rank0_step_ms_median']:.1f} ms, "
            f"longest while rank 1 away {killed['rank0_longest_step_ms_while_away']:.1f} ms over "
            f"{killed['rank0_steps_while_away']} steps); rank 1 back: started {killed['kill_to_start_s']:.2f} s, "
            f"pulled {killed['kill_to_pull_s']:.2f} s after the kill, at step {killed['back_start']}",
            flush=True,
        )

    def med(kind: str, key: str) -> float:
        return statistics.median(r[kind][key] for r in rounds)

    print(
        f"medians over {args.rounds} rounds: rank 0 wall killed/clean "
        f"{statistics.median(r['killed']['rank0_wall_s'] / r['clean']['rank0_wall_s'] for r in rounds):.3f}x; "
        f"longest step of rank 0 while rank 1 was away {med('killed', 'rank0_longest_step_ms_while_away'):.1f} ms "
        f"(median step {med('killed', 'rank0_step_ms_median'):.1f} ms); kill -> new process "
        f"{med('killed', 'kill_to_start_s'):.2f} s -> its first pull {med('killed', 'kill_to_pull_s'):.2f} s"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
