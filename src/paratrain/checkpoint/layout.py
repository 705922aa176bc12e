"""A checkpoint directory on disk: one folder per saved step, a ``latest`` pointer, atomic commits.

::

    D/
      latest                  the name of the newest complete checkpoint, e.g. "step-00000040"
      step-00000040/          one complete checkpoint
        .metadata             model and optimizer: torch.distributed.checkpoint's index …
        __0_0.distcp …        … and each rank's shard of the tensors
        train.pt              step, epoch, LR schedulers, grad scaler (written by rank 0)
        rank-00000.pt …       each rank's RNG states and data-loader positions
        hf-model/             a transformers model's config.json (for an export to Hugging Face)
        meta.json             who saved it and every file's size (subfolders' too); written last
      tmp-step-00000060/      a save in progress, or one that crashed: never read, removed by the next save

A save writes everything into ``tmp-…``, then rank 0 renames the folder and only then moves ``latest``
(write a temporary file, ``os.replace``). A crash at any moment leaves the previous checkpoint and the
pointer to it intact.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from ..errors import CheckpointError

LATEST = "latest"
META = "meta.json"
STEP_PREFIX = "step-"
TMP_PREFIX = "tmp-"
TRASH_PREFIX = "trash-"


def step_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def check_root(root: Path) -> None:
    """A checkpoint directory must be a directory (or not exist yet)."""
    if root.exists() and not root.is_dir():
        raise CheckpointError(
            f"cannot save a checkpoint into {root}: it is a file; checkpoints go into a directory "
            "(give a folder path, e.g. ckpt/)"
        )


def begin(root: Path, step: int) -> Path:
    """Rank 0: make ``root``, clear what crashed saves left behind, and return a fresh temporary folder."""
    root.mkdir(parents=True, exist_ok=True)
    for entry in root.iterdir():
        if entry.is_dir() and entry.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
            shutil.rmtree(entry, ignore_errors=True)
    tmp = root / f"{TMP_PREFIX}{step_name(step)}"
    tmp.mkdir()
    return tmp


def write_meta(folder: Path, meta: dict[str, Any]) -> None:
    """Record every file's size next to ``meta``, so a truncated file is caught before anything is read; files in
    subfolders (a parameter server's shard) by their path inside ``folder``."""
    files = {
        p.relative_to(folder).as_posix(): p.stat().st_size
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p != folder / META
    }
    write_file(folder / META, json.dumps({**meta, "files": files}, indent=1).encode())


def commit(root: Path, tmp: Path, step: int) -> Path:
    """Rank 0: publish the finished ``tmp`` folder as ``step-…`` and point ``latest`` at it."""
    final = root / step_name(step)
    if final.exists():  # the same step saved again (say, an explicit save right after an automatic one)
        final.rename(root / f"{TRASH_PREFIX}{final.name}")
    tmp.rename(final)
    fsync_dir(root)
    write_file(root / LATEST, final.name.encode())
    shutil.rmtree(root / f"{TRASH_PREFIX}{final.name}", ignore_errors=True)
    return final


def prune(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints (never the one ``latest`` names)."""
    current = latest(root)
    complete = sorted(_complete(root), key=lambda p: p.name)
    doomed = [p for p in complete[:-keep] if p != current]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def latest(root: Path) -> Path | None:
    """The checkpoint ``latest`` names; if the pointer is missing or stale, the newest complete one; else None."""
    pointer = root / LATEST
    try:
        name = pointer.read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        name = ""
    except OSError as e:
        raise CheckpointError(f"cannot read {pointer}: {e}") from None
    if name and "/" not in name and (root / name / META).is_file():
        return root / name
    complete = sorted(_complete(root), key=lambda p: p.name)
    return complete[-1] if complete else None


def checkpoint_folder(path: str | os.PathLike) -> Path:
    """The checkpoint folder a user means: a ``step-…`` folder itself, or a root whose latest one is taken."""
    p = Path(path)
    if (p / META).is_file():
        return p
    if not p.exists():
        raise CheckpointError(f"no checkpoint at {p}: the path does not exist")
    found = latest(p) if p.is_dir() else None
    if found is None:
        raise CheckpointError(f"no checkpoint in {p}: no complete step-* folder (a folder with {META}) is there")
    return found


def read_meta(folder: Path) -> dict[str, Any]:
    """``meta.json``, after checking that every file it lists is there at its recorded size."""
    try:
        meta = json.loads((folder / META).read_text())
        files = meta["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {folder} is damaged: cannot read {META} ({e})") from None
    for name, size in files.items():
        try:
            actual = (folder / name).stat().st_size
        except OSError:
            raise CheckpointError(f"checkpoint {folder} is incomplete: {name} is missing") from None
        if actual != size:
            raise CheckpointError(
                f"checkpoint {folder} is damaged: {name} has {actual} bytes, {size} were written; "
                "load an older checkpoint (delete this folder)"
            )
    return meta


def write_file(path: Path, data: bytes) -> None:
    """Write ``path`` atomically and durably: a temporary file, fsync, ``os.replace``, fsync of the folder."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk or a bad target must not leave the temporary file behind
        raise
    fsync_dir(path.parent)


def fsync_dir(folder: Path) -> None:
    """Make a rename inside ``folder`` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _complete(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return [p for p in root.iterdir() if p.name.startswith(STEP_PREFIX) and (p / META).is_file()]
