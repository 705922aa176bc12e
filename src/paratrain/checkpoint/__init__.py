"""Checkpoints: atomic, sharded, exact-resume saves of a ``Parallel`` job; safe loading; export.

* :mod:`.layout`: folders on disk, the ``latest`` pointer, atomic commits, keep-last-K;
* :mod:`.states`: model and optimizer state as torch.distributed.checkpoint saves it (strategies hook in);
* :mod:`.rng`: every RNG a rank draws from;
* :mod:`.io`: the collective save and load of a job;
* :mod:`.auto`: save every N steps, resume at start-up;
* :mod:`.safety`: loading never unpickles arbitrary objects;
* :mod:`.export`: a plain single-file state_dict.
"""
from .config import CheckpointConfig
from .export import export
from .io import Position, Targets, load, save
from .layout import latest

__all__ = ["CheckpointConfig", "Position", "Targets", "export", "latest", "load", "save"]
