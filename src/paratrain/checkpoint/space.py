"""A checkpoint that does not fit on its disk: say which disk and how much, and leave nothing half-written.

A full disk otherwise shows as a C++ error from deep inside torch's writer ("inline_container.cc … unexpected
pos") and leaves a ``tmp-step-*`` folder that keeps the disk full.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from . import layout

_FULL = (errno.ENOSPC, errno.EDQUOT)


def out_of_space(err: BaseException | None) -> bool:
    """Whether ``err`` (or what it wraps: DCP's failures, torch's writer errors) is a full disk or quota."""
    seen = 0
    while err is not None and seen < 8:
        if isinstance(err, OSError) and err.errno in _FULL:
            return True
        text = str(err)
        if "No space left on device" in text or "Disk quota exceeded" in text or "unexpected pos" in text:
            return True
        failures = getattr(err, "failures", None)
        if isinstance(failures, dict) and failures:
            return any(out_of_space(f[0] if isinstance(f, tuple) else f) for f in failures.values())
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


def disk_of(path: Path) -> str:
    """The mount point (and device) holding ``path``, e.g. ``/data (/dev/sdb1)``."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    try:
        with open("/proc/mounts") as f:
            devices = {fields[1]: fields[0] for fields in (line.split() for line in f) if len(fields) > 1}
    except OSError:
        devices = {}
    return f"{p} ({devices[str(p)]})" if str(p) in devices else str(p)


def needed_bytes(root: Path, fallback: int) -> int:
    """About what a checkpoint takes: the newest complete one's files, else ``fallback`` (this save's tensors)."""
    previous = layout.latest(root) if root.is_dir() else None
    if previous is not None:
        try:
            return sum(f.stat().st_size for f in previous.iterdir() if f.is_file())
        except OSError:
            pass
    return fallback


def no_space_message(root: Path, tmp: Path, fallback: int) -> str:
    """One line: the disk, the bytes needed and free, what was kept."""
    try:
        free = shutil.disk_usage(root if root.exists() else root.parent).free
    except OSError:
        free = 0
    previous = layout.latest(root) if root.is_dir() else None
    kept = f"the previous checkpoint {previous.name} is kept" if previous else "no earlier checkpoint exists"
    return (
        f"no space left on {disk_of(root)} for checkpoint {tmp.name}: it needs about "
        f"{_size(needed_bytes(root, fallback))}, {_size(free)} is free; the partial folder was removed and {kept}"
        "; free space there or save elsewhere (Parallel(checkpoint=DIR), --checkpoint-dir)"
    )


def remove_partial(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
