"""Automatic checkpoints: save every N optimizer steps, resume once at start-up.

A save is due after the N-th optimizer step but is written just before the next batch is fetched (or the next
step begins, or the job closes): by then the user's loop has finished that step (``scheduler.step()``, logging,
anything else that touches state or draws random numbers), and nothing of the next step has happened yet. A job
resumed from it continues exactly where the uninterrupted one went on.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from ..errors import CheckpointError
from . import layout
from .config import CheckpointConfig


class AutoCheckpoint:
    """The save-every-N and resume-at-start bookkeeping of one ``Parallel``."""

    def __init__(self, config: CheckpointConfig) -> None:
        self.config = config
        self._due = False
        self._started = False
        self._saved: tuple[Path, int] | None = None

    def root(self, path: str | os.PathLike | None) -> Path:
        """Where ``par.save``/``par.load`` go: ``path``, else ``checkpoint_dir``; neither is one line."""
        if path is None:
            if self.config.dir is None:
                raise CheckpointError("no checkpoint path given and no checkpoint_dir set "
                                      "(Parallel(checkpoint_dir=…) or paratrain run --checkpoint-dir)")
            path = self.config.dir
        return Path(path)

    def stepped(self, step: int) -> None:
        """Called after each optimizer step (``step`` counts them): marks a save as due every N steps."""
        if self.config.every is not None and step % self.config.every == 0:
            self._due = True

    def flush(self, save: Callable[[], object], step: int) -> None:
        """Write the due save, if any and unless an explicit ``par.save`` already wrote this step there."""
        if self._due:
            self._due = False
            if self.config.dir is not None and self._saved != (Path(self.config.dir).absolute(), step):
                save()

    def saved(self, root: Path, step: int) -> None:
        """A checkpoint of ``step`` was written into ``root``."""
        self._saved = (root.absolute(), step)

    def wants_resume(self) -> bool:
        """True until start-up has resumed (or a checkpoint was loaded), if the job is set to resume."""
        return not self._started and self.config.should_resume()

    def start(self) -> Path | None:
        """The checkpoint to resume from (once): ``dir``'s latest, or None when there is none yet."""
        self._started = True
        return layout.latest(Path(self.config.dir)) if self.config.dir else None

    def loaded(self) -> None:
        """A checkpoint was loaded by hand: start-up has nothing left to resume."""
        self._started = True
