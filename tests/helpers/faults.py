"""What the fault suite (tests/test_faults_*.py) asserts about every bad input and fault, and its tally.

Each case's outcome is checked for its class: a one-line error (or the one report of a failed rank), the exit
code, a bounded time, no process left, no file lost. With ``PARATRAIN_FAULT_LOG=FILE`` every checked case is
also appended to FILE as a JSON line; ``python tests/helpers/faults.py FILE`` prints the counts for
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

from paratrain.testing import alive


@dataclass
class Outcome:
    case: str
    kind: str
    """one-line error, report, warning, interrupted, wait report …"""
    raw_traceback: bool = False
    silent: bool = False
    unbounded: bool = False
    orphans: int = 0
    files_lost: int = 0


@dataclass
class Watched:
    """What :func:`watch_stderr` saw of a job."""

    rc: int | None
    stderr: str
    marked_at: float | None
    """``time.monotonic()`` when the first marked line was read (None: none was)."""
    ended: float
    """``time.monotonic()`` when the job had ended."""
    at_mark: object = None
    """What ``on_mark`` returned then."""


def watch_stderr(
    proc: subprocess.Popen,
    marked: Callable[[str], bool],
    timeout_s: float,
    *,
    keep_marked: bool = True,
    on_mark: Callable[[], object] | None = None,
) -> Watched:
    """Read ``proc``'s stderr on a thread until it exits (killed after ``timeout_s``), noting when the first line
    ``marked`` accepts arrives and calling ``on_mark`` then (the job's pids while they live, say); ``keep_marked``
    False leaves such lines out of the text (a fault script's own announcement)."""
    seen: dict[str, object] = {}

    def read() -> None:
        lines = []
        for line in proc.stderr:  # type: ignore[union-attr]
            mark = marked(line)
            if mark and "marked_at" not in seen:
                seen["marked_at"] = time.monotonic()
                seen["at_mark"] = on_mark() if on_mark is not None else None
            if keep_marked or not mark:
                lines.append(line)
        seen["stderr"] = "".join(lines)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        proc.wait(timeout=timeout_s)
    finally:
        proc.kill()
        reader.join(timeout=10)
    return Watched(
        rc=proc.returncode,
        stderr=str(seen.get("stderr", "")),
        ended=time.monotonic(),
        marked_at=seen.get("marked_at"),
        at_mark=seen.get("at_mark"),
    )  # type: ignore[arg-type]


HANG_REPORT = "paratrain: flight recorder: "


def split_hang_report(stderr: str) -> tuple[str, list[str]]:
    """``stderr`` without the launcher's flight-recorder report of a stalled collective (its header line and the
    indented lines under it), and that report's lines."""
    kept: list[str] = []
    report: list[str] = []
    inside = False
    for line in stderr.splitlines():
        inside = line.startswith(HANG_REPORT) or (inside and line.startswith("  "))
        (report if inside else kept).append(line)
    return "\n".join(kept), report


def check(
    case: str,
    *,
    rc: int | None,
    stderr: str,
    kind: str = "one-line error",
    expect_rc: int | Iterable[int] = 2,
    words: Iterable[str] = (),
    lines: int | None = 1,
    seconds: float | None = None,
    max_s: float | None = None,
    pids: Iterable[int] = (),
    kept: Iterable[str] = (),
) -> Outcome:
    """Assert the outcome of one case and record it (see the module docstring)."""
    text = stderr.strip()
    expected = {expect_rc} if isinstance(expect_rc, int) else set(expect_rc)
    traceback_lines = text.count("Traceback (most recent call last)")
    outcome = Outcome(
        case=case,
        kind=kind,
        raw_traceback=traceback_lines > (1 if kind == "report" else 0),
        silent=not text or rc not in expected,
        unbounded=seconds is not None and max_s is not None and seconds > max_s,
        orphans=len(alive(list(pids))),
        files_lost=sum(not os.path.exists(path) for path in kept),
    )
    _log(outcome)
    assert not outcome.raw_traceback, f"{case}: traceback in\n{stderr}"
    assert rc in expected, f"{case}: exit code {rc}, expected {sorted(expected)}\n{stderr}"
    assert text, f"{case}: nothing was said"
    if lines is not None:
        assert len(text.splitlines()) == lines, f"{case}: {len(text.splitlines())} lines, expected {lines}\n{stderr}"
    for word in words:
        assert word in text, f"{case}: {word!r} not in\n{stderr}"
    assert not outcome.unbounded, f"{case}: took {seconds:.1f} s (bound {max_s} s)"
    assert not outcome.orphans, f"{case}: {outcome.orphans} process(es) left running"
    assert not outcome.files_lost, f"{case}: a file that must be kept is gone"
    return outcome


def pids_in(folder, pattern: str) -> list[int]:
    """The pids the ranks of a test job wrote into ``folder``, as files matching ``pattern``."""
    return [int(p.read_text()) for p in folder.glob(pattern)]


def kill_alive(pids: Iterable[int]) -> None:
    """SIGKILL whichever of ``pids`` still runs (a failed test's leftovers)."""
    for pid in alive(pids):
        os.kill(pid, signal.SIGKILL)


def wait_for(paths: Iterable[str], timeout_s: float) -> bool:
    """Wait until every path exists (a job's ranks have started)."""
    deadline = time.monotonic() + timeout_s
    paths = list(paths)
    while time.monotonic() < deadline:
        if all(os.path.exists(p) for p in paths):
            return True
        time.sleep(0.1)
    return False


def _log(outcome: Outcome) -> None:
    path = os.environ.get("PARATRAIN_FAULT_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(asdict(outcome)) + "\n")


def tally(path: str) -> dict[str, int]:
    """Counts over a log (the last record of each case wins)."""
    with open(path) as f:
        cases = {o["case"]: o for o in map(json.loads, filter(None, f.read().splitlines()))}
    counts = {"cases": len(cases)}
    for kind in sorted({o["kind"] for o in cases.values()}):
        counts[f"kind: {kind}"] = sum(o["kind"] == kind for o in cases.values())
    for key in ("raw_traceback", "silent", "unbounded", "orphans", "files_lost"):
        counts[key] = sum(int(o[key]) for o in cases.values())
    return counts


if __name__ == "__main__":
    for key, value in tally(sys.argv[1]).items():
        print(f"{key}: {value}")
