"""Helpers for testing distributed training code on CPU, shipped for users' own test suites.

``spawn`` runs a function on N gloo processes with a hard timeout, forked from one server that imported torch and
paratrain once (``preload`` adds a suite's own heavy modules); ``max_abs_diff`` compares state dicts;
``alive`` tells whether processes are still running (to check that nothing was left behind);
``host_syncs.HostSyncs`` counts, on CPU, the reads of device values that would make a GPU's host wait.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from ..launcher.spawn import launch

PRELOAD = ["torch", "torch.distributed", "paratrain.parallel"]
"""What the fork server imports once for every job ``spawn`` starts (``preload`` adds to it)."""


def preload(*modules: str) -> None:
    """Have the fork server import ``modules`` too (transformers' model modules a suite builds): call it before the
    first ``spawn``, whose server then starts with them. Installed modules only: the server starts with Python's own
    ``sys.path``, not the caller's (a test folder's helpers import in each rank, as under spawn)."""
    PRELOAD.extend(m for m in modules if m not in PRELOAD)


def spawn(
    fn: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    *,
    timeout_s: float = 120.0,
    start_method: str = "forkserver",
    **kwargs: Any,
) -> list[Any]:
    """``paratrain.launch`` with a hard timeout by default, so a hung collective fails the test instead of CI; the
    ranks fork from a server that imported ``PRELOAD`` once (0.3 s a job, against seconds for each rank to import
    torch under ``start_method="spawn"``; the ranks still start in this process's environment and directory)."""
    if start_method == "forkserver":
        multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server starts: the first spawn
    return launch(fn, nprocs, args, timeout_s=timeout_s, start_method=start_method, **kwargs)


def max_abs_diff(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """Largest absolute difference between two state dicts with the same keys."""
    if a.keys() != b.keys():
        raise AssertionError(f"different keys: {sorted(set(a) ^ set(b))}")
    return max(((a[k].double() - b[k].double()).abs().max().item() for k in a), default=0.0)


def alive(pids: Iterable[int]) -> list[int]:
    """The pids that still name a running (not zombie) process."""
    running = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if state not in ("Z", "X"):
            running.append(pid)
    return running


def child_pids(parent: int | None = None) -> list[int]:
    """Direct children of ``parent`` (default: this process), from /proc, leaving out multiprocessing's own
    helpers (resource tracker, fork server), which live as long as the parent by design."""
    parent = os.getpid() if parent is None else parent
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                continue
            if ppid == parent and not _is_mp_helper(int(entry)):
                kids.append(int(entry))
    return kids


def _is_mp_helper(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
    except OSError:
        return False
    return b"resource_tracker" in cmd or b"forkserver" in cmd
