"""Pretrained weights read straight into a prepared model's shards: each rank reads only the bytes of what it holds.

Three ways in, one reader each: a safetensors file, a folder of them with transformers' index
(``model.safetensors.index.json``, as ``save_pretrained`` writes it), or a torch state-dict file (``torch.save``,
``pytorch_model.bin``, what ``paratrain export`` writes; ``export --format hf`` writes the second kind). safetensors
files are memory-mapped and read by slice (``safe_open(...).get_slice``); a torch file is loaded with ``mmap=True``, so
slicing it touches only its pages. A tensor transformers builds on load from several of the hub's (Mixtral's fused
experts from one matrix per expert) is built whole by its own conversion, then cut: the one read of more than a rank
holds.

Names are the user's (``named_parameters``): a checkpoint of a transformers base model loads into the model with a
head and the other way round (``base_model_prefix``), and a tied weight saved once (transformers saves the embedding,
not the head) is found under any name of its tie. Everything is checked on every rank and agreed before a byte is
copied, so a file for another model is one line and never a partly loaded model: names missing or unexpected, shapes
that differ, a truncated file. Values are converted to the dtype the prepared model holds (its precision's).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import CheckpointError
from ..model.facts import ModelFacts
from .hf import Derived, hub_tensors

INDEX = "model.safetensors.index.json"


@dataclass
class _Source:
    """The tensors of a weights file or folder, by name: shapes, and reads of slices."""

    path: Path
    files: dict[str, Path] = field(default_factory=dict)
    """name → the file holding it."""
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    derived: dict[str, Derived] = field(default_factory=dict)
    """model name → how transformers builds it from hub tensors of this source (:func:`.hf.hub_tensors`)."""
    _open: dict[Path, Any] = field(default_factory=dict)
    _torch: dict[str, torch.Tensor] | None = None
    bytes_read: int = 0

    @contextmanager
    def reading(self, file: Path) -> Iterator[None]:
        """Keep ``file`` mapped while its tensors are read, and only then: the pages a rank touched leave its
        resident memory when the mapping closes, so at most one file's slices are resident at once."""
        if self._torch is not None:
            yield
            return
        from safetensors import safe_open

        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as err:
            raise _unreadable(file, err) from None
        with handle:
            self._open[file] = handle
            try:
                yield
            finally:
                del self._open[file]

    def read(self, name: str, index: tuple[slice, ...] | None) -> torch.Tensor:
        """The tensor ``name``, or its ``index`` part (one slice per dimension); its file must be ``reading``. A derived
        tensor is built whole from the hub tensors it needs (each opened for the read), then cut."""
        if name in self.derived:
            whole = self.derived[name].build(self._whole)
            return whole[index] if index is not None else whole
        try:
            if self._torch is not None:
                t = self._torch[name]
                out = (t[index] if index is not None else t).clone()
            else:
                f = self._open[self.files[name]]
                out = f.get_slice(name)[index] if index is not None else f.get_tensor(name)
        except Exception as err:  # safetensors raises its own error types, torch a RuntimeError
            raise _unreadable(self.files.get(name, self.path), err) from None
        self.bytes_read += out.numel() * out.element_size()
        return out

    def _whole(self, key: str) -> torch.Tensor:
        if self._torch is not None or self.files[key] in self._open:
            return self.read(key, None)
        with self.reading(self.files[key]):
            return self.read(key, None)


def _unreadable(path: Path, err: BaseException) -> CheckpointError:
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return CheckpointError(
        f"cannot read weights from {path} ({first}); the file is truncated or not a safetensors / "
        "torch file: write it again"
    )


def _safetensors_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    index = path / INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as err:
            raise CheckpointError(f"{index} is not a safetensors index (no weight_map: {err})") from None
        return sorted({path / f for f in weight_map.values()})
    return sorted(path.glob("*.safetensors"))


def open_source(path: str | os.PathLike) -> _Source:
    """The weights at ``path``: a ``.safetensors`` file, a folder of them (with or without transformers' index), or a
    torch state-dict file (``.pt``, ``.bin``, ``paratrain export``'s output, a folder's ``pytorch_model.bin``)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(
            f"no weights at {path}: give a .safetensors file, a folder of them, or a torch state-dict file"
        )
    source = _Source(path)
    files = _safetensors_files(path) if path.is_dir() or path.suffix == ".safetensors" else []
    if path.is_dir() and not files and (path / "pytorch_model.bin").exists():
        path = path / "pytorch_model.bin"
    if files:
        from safetensors import safe_open

        for f in files:
            if not f.exists():
                raise CheckpointError(f"{path / INDEX} names {f.name}, which is missing: copy the whole folder")
            try:
                with safe_open(str(f), framework="pt", device="cpu") as handle:
                    for name in handle.keys():
                        source.files[name] = f
                        source.shapes[name] = tuple(handle.get_slice(name).get_shape())
            except Exception as err:
                raise _unreadable(f, err) from None
        return source
    if path.is_dir():
        raise CheckpointError(f"{path} holds no .safetensors file and no pytorch_model.bin")
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as err:
        raise _unreadable(path, err) from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(
            f"{path} is not a state dict ({{name: tensor}}); save one with torch.save(model."
            "state_dict(), path) or paratrain export"
        )
    source._torch = state
    source.files = {k: path for k in state}
    source.shapes = {k: tuple(v.shape) for k, v in state.items()}
    return source


def held_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's parameters and persistent buffers by the user's names (non-persistent buffers, rotary tables,
    are not in checkpoints)."""
    out: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for key, buf in module._buffers.items():
            if buf is not None and key not in module._non_persistent_buffers_set:
                out[f"{mod_name}.{key}" if mod_name else key] = buf
    return out


def _prefix(model: nn.Module) -> str | None:
    return next((m.base_model_prefix for m in model.modules() if getattr(m, "base_model_prefix", "")), None)


def _candidates(name: str, prefix: str | None, facts: ModelFacts | None) -> Iterator[str]:
    """The names a checkpoint may hold ``name`` under: itself, without or with the base model's prefix, and the
    same for the other names of its tie."""
    names = [name]
    if facts is not None:
        names += [n for group in facts.ties.groups if name in group for n in group if n != name]
    for n in names:
        yield n
        if prefix:
            yield n[len(prefix) + 1 :] if n.startswith(prefix + ".") else f"{prefix}.{n}"


def _global_shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)  # a DTensor's shape is the global one


def local_index(t: torch.Tensor) -> tuple[tuple[slice, ...], list[torch.Tensor | None]] | None:
    """For a DTensor: per dimension the slice of the global tensor bounding its local part, and where that part is
    not one contiguous run (FSDP's strided shard over a tensor-parallel one), the positions to keep inside the slice.
    None for a plain tensor (all of it)."""
    if not (hasattr(t, "device_mesh") and hasattr(t, "placements")):
        return None
    from torch.distributed.tensor import distribute_tensor

    mesh, shape, placements = t.device_mesh, t.shape, t.placements
    # how many pieces each dimension is cut into (a dimension other than d is given just that many rows, so that
    # every rank's piece of it is one row and only dimension d's positions remain to read)
    pieces = [1] * len(shape)
    for mesh_dim, placement in enumerate(placements):
        dim = getattr(placement, "dim", None)
        if dim is not None:
            pieces[dim] *= mesh.size(mesh_dim)
    slices, picks = [], []
    for d, n in enumerate(shape):
        sizes = [n if i == d else pieces[i] for i in range(len(shape))]
        positions = torch.arange(n).view([n if i == d else 1 for i in range(len(shape))]).expand(sizes).contiguous()
        # on a CUDA mesh distribute_tensor moves the positions to the GPU; they index the host read (and are compared
        # with host ranges) below, so they come back
        local = distribute_tensor(positions, mesh, placements, src_data_rank=None).to_local().cpu()
        flat = local.movedim(d, 0).reshape(local.shape[d], -1)[:, 0] if local.numel() else local.new_empty(0)
        if flat.numel() == 0:
            slices.append(slice(0, 0))
            picks.append(None)
            continue
        lo, hi = int(flat.min()), int(flat.max()) + 1
        slices.append(slice(lo, hi))
        picks.append(None if hi - lo == flat.numel() and bool((flat == torch.arange(lo, hi)).all()) else flat - lo)
    return tuple(slices), picks


def _read_into(source: _Source, key: str, target: torch.Tensor) -> None:
    index = local_index(target)
    with torch.no_grad():
        if index is None:
            target.copy_(source.read(key, None))
            return
        slices, picks = index
        part = source.read(key, slices)
        for d, pick in enumerate(picks):
            if pick is not None:
                part = part.index_select(d, pick)
        target.to_local().copy_(part)


def _agreed(problem: str | None) -> str | None:
    """The first problem any rank found (every rank raises alike), or None."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return problem
    found: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(found, problem)
    return next((p for p in found if p), None)


def _few(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def load_weights(model: nn.Module, path: str | os.PathLike, facts: ModelFacts | None = None) -> dict[str, Any]:
    """Copy the weights at ``path`` into ``model`` (a prepared model, unwrapped: its tensors may be shards), each
    rank reading only what it holds; collective. Returns what was read: tensors, bytes, files."""
    facts = facts if facts is not None else ModelFacts.of(model)
    held = held_tensors(model)
    source, plan, aliases, problem = None, {}, set(), None
    try:
        source = open_source(path)
        plan, aliases = _plan(source, held, model, facts)
    except CheckpointError as err:
        problem = str(err)
    problem = _agreed(problem)
    if problem is None:
        assert source is not None
        used = set(plan.values()) | aliases | {k for d in source.derived.values() for k in d.keys}
        problem = _agreed_unexpected(source, used)
    if problem is not None:
        raise CheckpointError(problem)
    assert source is not None
    try:
        by_file: dict[Path, list[tuple[str, str]]] = {}
        for name, key in plan.items():
            if key in source.derived:
                _read_into(source, key, held[name])
            else:
                by_file.setdefault(source.files[key], []).append((name, key))
        for file, items in by_file.items():
            with source.reading(file):
                for name, key in items:
                    _read_into(source, key, held[name])
    except CheckpointError as err:
        problem = str(err)
    problem = _agreed(problem)
    if problem is not None:
        raise CheckpointError(f"{problem}; the model's weights are now partly loaded: load again or rebuild")
    return {"tensors": len(plan), "bytes_read": source.bytes_read, "files": len(set(source.files.values()))}


def _plan(
    source: _Source, held: dict[str, torch.Tensor], model: nn.Module, facts: ModelFacts
) -> tuple[dict[str, str], set[str]]:
    """held name → checkpoint key, and the keys of tied tensors' other names (read once, under the first); a
    ``CheckpointError`` naming the first missing or mis-shaped tensors. A transformers model's tensors that the file
    holds in the hub's layout (per-expert matrices of a fused expert tensor) are derived from it."""
    plan: dict[str, str] = {}
    aliases: set[str] = set()
    missing, shapes, planned = [], [], set()
    prefix = _prefix(model)
    absent = [n for n, t in held.items() if not any(k in source.shapes for k in _candidates(n, prefix, facts))]
    renamed, derived = hub_tensors(model, source.shapes, absent) if absent else ({}, {})
    for name, t in held.items():
        if name in derived:
            source.derived[name], shape = derived[name]
            if shape != _global_shape(t):
                shapes.append(f"{name} {list(shape)} in the file, {list(_global_shape(t))} here")
            plan[name] = name
            planned.add(id(t))
            continue
        key = next((k for k in _candidates(name, prefix, facts) if k in source.shapes), renamed.get(name))
        if key is None and id(t) in planned:
            continue  # a tied tensor, read under another of its names
        if key is None:
            missing.append(name)
        elif source.shapes[key] != _global_shape(t):
            shapes.append(f"{name} {list(source.shapes[key])} in the file, {list(_global_shape(t))} here")
        elif id(t) in planned:
            aliases.add(key)
        else:
            planned.add(id(t))
            plan[name] = key
    if missing:
        raise CheckpointError(
            f"{source.path} lacks {len(missing)} tensor(s) of the model: {_few(missing)}; is it "
            "this model's checkpoint?"
        )
    if shapes:
        raise CheckpointError(
            f"{source.path} has tensors of other shapes than the model: {_few(shapes)}; is it this model's?"
        )
    return plan, aliases


def _agreed_unexpected(source: _Source, used: set[str]) -> str | None:
    """The checkpoint's tensors no rank reads (every rank computes the same line)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        every: list[set[str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(every, used)
        used = set().union(*[u for u in every if u])
    unexpected = sorted(set(source.shapes) - used)
    if not unexpected:
        return None
    return (
        f"{source.path} holds {len(unexpected)} tensor(s) the model has not: {_few(unexpected)}; is it this "
        "model's checkpoint?"
    )
