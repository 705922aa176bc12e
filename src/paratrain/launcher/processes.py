"""Which processes this launcher started are running (Linux ``/proc``; nothing is known elsewhere)."""

from __future__ import annotations

import os


def children() -> list[int]:
    """This process's child pids (empty where ``/proc/*/task/*/children`` is not available)."""
    pids: list[int] = []
    try:
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children") as f:
                pids += [int(p) for p in f.read().split()]
    except OSError:
        pass
    return pids


def running(pids: list[int]) -> int:
    """How many of ``pids`` still run (a zombie has stopped, it is merely not reaped yet)."""
    n = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                n += f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            continue
    return n
