"""What porting a script to ``Parallel`` costs per step: nanoGPT's training step by hand on torch DDP against the
same step ported (docs/porting.md), and zero3 evaluation forwards (ten per timed item) with paratrain's meeting of
the ranks before each, without it, and hand-written FSDP2 ones, side by side at world size 2 on CPU/gloo
(``porting_job.py``: one job, alternating blocks).

Reported per arm: the median over rounds of the block's median step (slowest rank: rank 0 times after a barrier),
and the ratio to its hand-written twin. The background load of other processes is reported too (above 5%: flagged).

Run (about 2 minutes on 2 cores):
    cd /work/main && .venv/bin/python benchmarks/porting_overhead.py [--rounds 5] [--steps 20] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from paratrain.bench.machine import BackgroundLoad

HERE = Path(__file__).resolve().parent
TWINS = {
    "ddp ported, forward_backward": "ddp by hand",
    "ddp ported, model(X, Y) + par.backward": "ddp by hand",
    "zero3 evaluation ported": "zero3 evaluation by hand",
    "zero3 evaluation ported, no meetings": "zero3 evaluation by hand",
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--json")
    args = p.parse_args()
    load = BackgroundLoad()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "paratrain",
                "run",
                "-n",
                "2",
                str(HERE / "porting_job.py"),
                str(out),
                str(args.rounds),
                str(args.steps),
            ],
            check=True,
            timeout=1800,
        )
        times = json.loads(out.read_text())
    medians = {arm: statistics.median(statistics.median(block) for block in blocks) for arm, blocks in times.items()}
    ratios = {
        arm: statistics.median(statistics.median(a) / statistics.median(b) for a, b in zip(times[arm], times[twin]))
        for arm, twin in TWINS.items()
    }
    share = load.share()
    print(
        f"world 2, CPU/gloo, {args.rounds} rounds x {args.steps} steps; background load {share:.1%}"
        + (" (flagged: above 5%)" if share > 0.05 else "")
    )
    for arm, ms in medians.items():
        twin = f"  {ratios[arm]:.3f}x {TWINS[arm]}" if arm in ratios else ""
        print(f"  {arm:42s} {ms * 1e3:8.1f} ms{twin}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "medians_s": medians,
                    "ratios": ratios,
                    "background_share": share,
                    "rounds": args.rounds,
                    "steps": args.steps,
                    "times": times,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
