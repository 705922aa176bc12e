"""Keeping the unit lane (``make test-fast``) free of processes.

``make test-fast`` runs ``-m "not launched"`` with ``PARATRAIN_UNIT_LANE=1`` set. Under that variable a test without
the ``launched`` marker that starts a process (``paratrain.testing.spawn``, a subprocess, a multiprocessing child,
a fork) fails at that call, naming the marker, instead of quietly making the lane slow. It wraps each test's whole
run, fixtures included, since a module-scoped fixture that launches a job is set up before any autouse fixture of
the test.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

VAR = "PARATRAIN_UNIT_LANE"


def guarded(item: pytest.Item) -> bool:
    """Whether ``item`` runs under the guard: in the unit lane and not marked ``launched``."""
    return bool(os.environ.get(VAR)) and item.get_closest_marker("launched") is None


@contextmanager
def no_process(test: str) -> Iterator[None]:
    """Within, starting a process fails ``test``."""

    def refuse(*args: object, **kwargs: object) -> None:
        pytest.fail(f"{test} starts a process: mark it `launched` (the unit lane, {VAR}=1, starts none)")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "_execute_child", refuse)
        patch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
        patch.setattr(os, "fork", refuse)
        yield
