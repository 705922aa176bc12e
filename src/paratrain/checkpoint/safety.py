"""Loading a checkpoint never runs code from it.

A pickle can name any importable function and make the unpickler call it, so a checkpoint from someone else is
a program unless every unpickling is restricted. What a checkpoint holds and how each part is read:

* ``train.pt``, ``rank-*.pt``: ``torch.load(weights_only=True)`` (tensors and plain Python values only).
* tensors in ``*.distcp``: torch.distributed.checkpoint itself reads them with ``weights_only=True``.
* ``.metadata``: DCP reads it with a plain ``pickle.load``. :class:`SafeReader` first unpickles it with an
  allow-list of DCP's own metadata classes, torch dtypes and paths, and refuses the file if it names anything else.
* non-tensor values in ``*.distcp`` (optimizer hyper-parameters such as ``betas``): DCP reads them with
  ``torch.load(weights_only=False)``. :class:`SafePlanner` first loads each with ``weights_only=True`` and
  refuses it if that fails.

The checks run before DCP's own reads, on the same bytes, so DCP only ever unpickles what passed them.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from ..errors import CheckpointError

_METADATA_GLOBALS = (
    {
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "ChunkStorageMetadata",
            "BytesStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    }
    | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # maps a layout's name ("torch.strided") to the layout
        ("collections", "OrderedDict"),
    }
    | {
        (module, cls)
        for module in ("pathlib", "pathlib._local")
        for cls in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")
    }
)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(f"refers to {module}.{name}, which is not part of a checkpoint's metadata")


def check_metadata(path: Path) -> None:
    """Unpickle DCP's ``.metadata`` with the allow-list; raise ``CheckpointError`` if it is unsafe or damaged."""
    try:
        with open(path, "rb") as f:
            _MetadataUnpickler(f).load()
    except CheckpointError as e:
        raise CheckpointError(f"refusing to load {path}: it {e}") from None
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path.parent} is incomplete: {path.name} is missing") from None
    except Exception as e:  # truncated or garbage bytes fail in many ways
        raise CheckpointError(
            f"checkpoint {path.parent} is damaged: cannot read {path.name} ({torch_reason(e)})"
        ) from None


class SafeReader(FileSystemReader):
    """DCP's file reader, with the metadata checked by the allow-list before DCP unpickles it."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        check_metadata(Path(self.path) / ".metadata")
        return super().read_metadata(*args, **kwargs)


class SafePlanner(DefaultLoadPlanner):
    """DCP's load planner, with every non-tensor value checked by ``weights_only=True`` before DCP loads it."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            torch.load(value, weights_only=True)
        except Exception as e:
            raise CheckpointError(
                f"refusing to load the value of {read_item.dest_index.fqn!r}: it is damaged or not "
                f"plain data ({torch_reason(e)})"
            ) from None
        value.seek(0)
        super().load_bytes(read_item, value)


_ADVICE = (
    " In PyTorch 2.6",
    " Re-running `torch.load`",
    " This is an internal",
    " If you are seeing this",
    " Please file",
)


def torch_reason(err: BaseException) -> str:
    """``Type: first sentence`` of an error torch raised while reading, without its advice: torch's advice for a
    file that fails ``weights_only=True`` is to load it with ``weights_only=False``, which is what a damaged or
    planted file must never get."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    for marker in _ADVICE:
        text = text.split(marker, 1)[0]
    return f"{type(err).__name__}: {text.strip()[:200]}"


def load_file(path: Path) -> Any:
    """``torch.load`` of one of paratrain's own files in a checkpoint, tensors and plain values only."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path.parent} is incomplete: {path.name} is missing") from None
    except Exception as e:
        raise CheckpointError(
            f"checkpoint {path.parent} is damaged or unsafe: cannot load {path.name} "
            f"({torch_reason(e)}); load an older checkpoint (delete this folder)"
        ) from None
