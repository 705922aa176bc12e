"""A checkpoint's model as one plain file: ``{name: tensor}`` with full (unsharded) tensors and no wrapper
prefixes, readable with ``torch.load(path, weights_only=True)`` and loadable into the plain model."""

from __future__ import annotations

import inspect
import io
import os
from pathlib import Path

import torch

from ..errors import CheckpointError
from . import layout
from .io import DCP_ERRORS, load_failure, quiet_single_process
from .safety import SafePlanner, SafeReader


def export(
    path: str | os.PathLike, out: str | os.PathLike, *, model: int = 0, force: bool = False
) -> dict[str, object]:
    """Consolidate model ``model`` of the checkpoint at ``path`` (a ``step-…`` folder or a root) into ``out``.

    Runs in one process, whatever world size wrote the checkpoint: torch.distributed.checkpoint reads every
    shard. An existing ``out`` is replaced only with ``force`` (it may be the only copy of other weights); a
    directory never is. Returns what was written (path, step, tensors, bytes).
    """
    _check_out(Path(out), force)
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    folder = layout.checkpoint_folder(path)
    meta = layout.read_meta(folder)
    if not 0 <= model < len(meta["models"]):
        raise CheckpointError(f"checkpoint {folder} holds {len(meta['models'])} model(s); there is no model {model}")
    reader = SafeReader(folder)
    prefix = ("model" if model == 0 else f"model_{model}") + "."
    state: dict[str, object] = {}
    for key, item in reader.read_metadata().state_dict_metadata.items():
        if key.startswith(prefix):
            name = key[len(prefix) :]
            state[name] = (
                torch.empty(item.size, dtype=item.properties.dtype) if isinstance(item, TensorStorageMetadata) else None
            )
    single = {"no_dist": True} if "no_dist" in inspect.signature(load).parameters else {}
    try:
        with quiet_single_process():
            load({prefix[:-1]: state}, storage_reader=reader, planner=SafePlanner(), **single)
    except DCP_ERRORS as e:
        raise load_failure(folder, e) from None
    if model == 0:
        state.update(server_shards(folder))
    buf = io.BytesIO()
    torch.save(state, buf)
    out = Path(out)
    _check_out(out, force)  # again: the read took a while
    if out.parent != Path(""):
        out.parent.mkdir(parents=True, exist_ok=True)
    layout.write_file(out, buf.getvalue())
    tensors = [v for v in state.values() if isinstance(v, torch.Tensor)]
    return {
        "path": out,
        "step": meta["step"],
        "tensors": len(tensors),
        "bytes": out.stat().st_size,
        "parameters": sum(t.numel() for t in tensors),
    }


def server_shards(folder: Path) -> dict[str, torch.Tensor]:
    """The model tensors a parameter-server job's servers wrote into ``folder/server-NNN`` (none for other jobs):
    the dense parameters each owns, and the rows of each table put back together in order."""
    from .single import read_alone

    whole: dict[str, torch.Tensor] = {}
    rows: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for sub in sorted(p for p in folder.iterdir() if p.is_dir() and p.name.startswith("server-")):
        try:
            part = read_alone(str(sub))
        except DCP_ERRORS as e:
            raise load_failure(sub, e) from None
        for key, value in part.items():
            if not key.startswith("model."):
                continue
            name = key[len("model.") :]
            if f"rows.{name}" in part:
                rows.setdefault(name, []).append((int(part[f"rows.{name}"][0]), value))
            else:
                whole[name] = value
    for name, chunks in rows.items():
        whole[name] = torch.cat([t for _, t in sorted(chunks, key=lambda c: c[0])])
    return whole


def _check_out(out: Path, force: bool) -> None:
    if out.is_dir():
        raise CheckpointError(f"cannot export to {out}: it is a directory; give a file path such as {out / 'model.pt'}")
    if out.exists() and not force:
        raise CheckpointError(f"{out} exists; pass --force (force=True) to replace it, or choose another path")
