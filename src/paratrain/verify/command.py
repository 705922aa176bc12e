"""``paratrain verify`` end to end: run the checks, print each verdict (or JSON), exit 0 only when all pass."""

from __future__ import annotations

import json
from dataclasses import asdict

from . import verify_cases
from .distributed import Case
from .report import format_report


def verify_command(
    *,
    factory: str,
    strategies: str | None,
    nprocs: int,
    steps: int | None,
    tolerance: float | None,
    timeout_s: float,
    accelerator: str,
    as_json: bool,
    tp: int | None = None,
    script_args: list[str] | None = None,
) -> int:
    """Check ``factory`` under each comma-separated strategy on ``nprocs`` processes; 0 when every one passes.
    ``tp``: the tensor-parallel degree inside ddp/zero2/zero3 (the ``tp`` strategy splits over every rank).
    ``script_args``: ``factory`` is a script, run with these arguments (:mod:`paratrain.verify.script`); without
    strategies it keeps its own."""
    from ..distributed.tensor_parallel.degrees import cli_options

    names = [s.strip() for s in (strategies or "").split(",") if s.strip()]
    if script_args is not None:
        from .script import verify_script

        options = {"tp": tp} if tp not in (None, 1) else {}
        reports = verify_script(
            factory,
            script_args,
            names or [None],
            nprocs,
            steps=steps,
            options=options,
            tolerance=tolerance,
            timeout_s=timeout_s,
        )
    else:
        cases = [
            Case(factory=factory, strategy=name, steps=steps, options=cli_options(name, None if name == "tp" else tp))
            for name in names or ["ddp"]
        ]
        reports = verify_cases(cases, nprocs, tolerance=tolerance, timeout_s=timeout_s, accelerator=accelerator)
    if as_json:
        print(json.dumps([{"verdict": r.verdict, **asdict(r)} for r in reports], indent=1))
    else:
        print("\n\n".join(format_report(r) for r in reports))
    return 0 if all(r.passed for r in reports) else 1
