"""`paratrain verify` on a GPT-2 script's loop: its verdict on the correct loop and on each bug users plant in it.

The loop (tests/helpers/verify_cases.py, ``own_*``) has a loader class of its own (random offsets into one token
tensor, no DataLoader), micro-steps in ``range(par.accumulate)`` and the gradient norm clipped at 1.0; the bugs are
a bare ``loss.backward()``, the script's own ``/ grad_accum_steps`` kept beside ``par.backward``, a summed loss,
every rank drawing the same offsets, and ranks building different initial weights (a note, not a fault: ``prepare``
starts every rank from rank 0's weights). One job per world size runs every case.

    python benchmarks/verify_verdicts.py [--strategies ddp,zero3] [--cases own_loader,own_undivided] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

CASES = (
    "own_loader",
    "own_loader_a4",
    "own_undivided",
    "own_double",
    "own_summed",
    "own_same_offsets",
    "own_rank_seeded",
)


def _first(text: str, width: int = 90) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def main() -> None:
    from paratrain.verify import Case, verify_cases

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default="ddp,zero3")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    names = args.cases.split(",")
    cases = [
        Case(factory=f"helpers.verify_cases:{name}", strategy=strategy, steps=args.steps)
        for strategy in args.strategies.split(",")
        for name in names
    ]
    start = time.perf_counter()
    reports = verify_cases(cases, 2, timeout_s=300, accelerator="cpu")
    took = time.perf_counter() - start
    rows = []
    print("| case | strategy | accumulate | verdict | cause named | fix |\n|---|---|---|---|---|---|")
    for case, report in zip(cases, reports):
        finding = report.findings[0] if report.findings else None
        row = {
            "case": case.factory.split(":")[1],
            "strategy": case.strategy,
            "accumulate": report.accumulate,
            "verdict": report.verdict,
            "cause": finding.cause if finding else (report.notes[0] if report.notes else ""),
            "fix": finding.hint if finding else "",
            "error": report.error,
        }
        rows.append(row)
        cause = row["error"] or row["cause"]
        print(
            f"| {row['case']} | {row['strategy']} | {row['accumulate']} | {row['verdict']} | {_first(cause)} "
            f"| {_first(row['fix'], 60)} |"
        )
    print(f"\n{len(cases)} cases in one job of 2 processes plus their references: {took:.0f} s")
    if args.out:
        args.out.write_text(json.dumps({"took_s": took, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
