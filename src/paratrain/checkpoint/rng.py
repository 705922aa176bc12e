"""Every random number generator a rank draws from, captured and restored, so a resumed job draws the same
numbers the uninterrupted one would have (dropout masks, augmentation, sampling)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture() -> dict[str, Any]:
    """Python's, NumPy's and torch's global generators (and every CUDA device's, once CUDA is in use), as
    tensors and plain values that ``torch.load(weights_only=True)`` reads back."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: dict[str, Any]) -> None:
    """Set the generators ``capture`` saw (CUDA only when this process has as many devices)."""
    random.setstate(_as_tuples(state["python"]))
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def _as_tuples(value: Any) -> Any:
    """``random.setstate`` wants tuples all the way down."""
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value
