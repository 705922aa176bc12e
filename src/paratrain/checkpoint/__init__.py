"""Checkpoints: atomic, sharded, exact-resume saves of a ``Parallel`` job; safe loading; export.

* :mod:`.layout`: folders on disk, the ``latest`` pointer, atomic commits, keep-last-K;
* :mod:`.states`: model and optimizer state as torch.distributed.checkpoint saves it (strategies hook in);
* :mod:`.rng`: every RNG a rank draws from;
* :mod:`.io`: the collective save and load of a job;
* :mod:`.background`: saves written in the background while training goes on;
* :mod:`.auto`: save every N steps, resume at start-up;
* :mod:`.safety`: loading never unpickles arbitrary objects;
* :mod:`.export`: a plain single-file state_dict, or (:mod:`.hf`) a Hugging Face folder.
"""

from __future__ import annotations

from ..lazy import lazy_getattr
from .config import CheckpointConfig as CheckpointConfig
from .layout import latest as latest

_LAZY = {"export": ".export", "Position": ".io", "Targets": ".io", "load": ".io", "save": ".io"}
"""Imported on first use: torch.distributed.checkpoint takes 1-2 s to import, and every ``Parallel`` imports
this package for its configuration."""

__all__ = sorted(["CheckpointConfig", "latest", *_LAZY])
__getattr__ = lazy_getattr(__name__, _LAZY, globals())
