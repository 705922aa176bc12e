"""The one way tests run the CLI: as a subprocess (``run_cli(...)``, what a user's shell does) or in this process
(``in_process(...)``, for its exit code and stderr without starting an interpreter)."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from typing import Any

PARATRAIN = [sys.executable, "-m", "paratrain"]
"""The CLI as a command, from this interpreter's environment (``paratrain`` on PATH may be another install)."""


def run_cli(*args: object, timeout: float = 120, **kwargs: Any) -> subprocess.CompletedProcess:
    """``paratrain ARGS`` in a subprocess, its output captured as text; ``timeout`` bounds a hang."""
    return subprocess.run([*PARATRAIN, *map(str, args)], capture_output=True, text=True, timeout=timeout, **kwargs)


def in_process(argv: list[str]) -> tuple[int, str]:
    """``paratrain ARGV`` through ``cli.main`` here: its exit code and what it wrote to stderr."""
    from paratrain.cli.main import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = main(list(argv))
        except SystemExit as e:
            rc = e.code
    return rc, err.getvalue()
