"""A checkpoint's model as one plain file: ``{name: tensor}`` with full (unsharded) tensors and no wrapper
prefixes, readable with ``torch.load(path, weights_only=True)`` and loadable into the plain model; or as a Hugging
Face folder (:mod:`.hf`)."""

from __future__ import annotations

import inspect
import io
import os
from pathlib import Path

import torch

from ..errors import CheckpointError, ConfigError
from . import layout
from .io import DCP_ERRORS, load_failure, quiet_single_process
from .safety import SafePlanner, SafeReader

FORMATS = ("pt", "hf")


def export(
    path: str | os.PathLike,
    out: str | os.PathLike,
    *,
    model: int = 0,
    force: bool = False,
    format: str = "pt",
    config: str | os.PathLike | None = None,
    shard_bytes: int | None = None,
) -> dict[str, object]:
    """Consolidate model ``model`` of the checkpoint at ``path`` (a ``step-…`` folder or a root) into ``out``.

    Runs in one process, whatever world size wrote the checkpoint: torch.distributed.checkpoint reads every
    shard. ``format="pt"``: one ``torch.save`` file; an existing ``out`` is replaced only with ``force`` (it may be
    the only copy of other weights), a directory never is. ``format="hf"``: a new folder ``from_pretrained`` loads
    (:mod:`.hf`), with the config the checkpoint holds or ``config`` (a folder with ``config.json``), in safetensors
    shards of at most ``shard_bytes``. Returns what was written (path, step, tensors, bytes).
    """
    if format not in FORMATS:
        raise ConfigError(f"unknown export format {format!r}; choose one of {', '.join(FORMATS)}")
    if shard_bytes is not None and shard_bytes <= 0:
        raise ConfigError(f"the largest shard must be positive, not {shard_bytes} bytes")
    out = Path(out)
    if format == "hf":
        return _export_hf(path, out, model, config, shard_bytes)
    _check_out(out, force)
    folder = layout.checkpoint_folder(path)
    meta = layout.read_meta(folder)
    state = read_model(folder, meta, model)
    buf = io.BytesIO()
    torch.save(state, buf)
    _check_out(out, force)  # again: the read took a while
    if out.parent != Path(""):
        out.parent.mkdir(parents=True, exist_ok=True)
    layout.write_file(out, buf.getvalue())
    return _written(out, meta, state, out.stat().st_size)


def _export_hf(
    path: str | os.PathLike, out: Path, model: int, config: str | os.PathLike | None, shard_bytes: int | None
) -> dict[str, object]:
    from . import hf

    _check_new_folder(out)
    hf.writer_class()
    folder = layout.checkpoint_folder(path)
    meta = layout.read_meta(folder)
    config_dir = Path(config) if config is not None else hf.config_folder(folder, model)
    if not (config_dir / "config.json").is_file():
        raise ConfigError(
            f"{config_dir} holds no config.json: give --config DIR (a folder with the model's config.json)"
            if config is not None
            else f"checkpoint {folder} holds no Hugging Face config (its model {model} is not a transformers model); "
            "give --config DIR (a folder with the model's config.json)"
        )
    state = hf.hub_state(read_model(folder, meta, model), hf.skeleton(config_dir))
    _check_new_folder(out)  # again: the read took a while
    with quiet_single_process():
        hf.write_folder(state, out, config_dir, shard_bytes or hf.SHARD_BYTES)
    return _written(out, meta, state, sum(p.stat().st_size for p in out.iterdir()))


def read_model(folder: Path, meta: dict[str, object], model: int) -> dict[str, torch.Tensor]:
    """Model ``model`` of checkpoint ``folder``, whole, by the plain model's names (one process reads every shard)."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    count = len(meta["models"])  # type: ignore[arg-type]
    if not 0 <= model < count:
        raise CheckpointError(f"checkpoint {folder} holds {count} model(s); there is no model {model}")
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
    return state  # type: ignore[return-value]


def _written(out: Path, meta: dict[str, object], state: dict[str, object], nbytes: int) -> dict[str, object]:
    tensors = [v for v in state.values() if isinstance(v, torch.Tensor)]
    return {
        "path": out,
        "step": meta["step"],
        "tensors": len(tensors),
        "bytes": nbytes,
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


def _check_new_folder(out: Path) -> None:
    if out.exists():
        raise CheckpointError(f"{out} exists; a Hugging Face export goes into a new folder: remove it or name another")
