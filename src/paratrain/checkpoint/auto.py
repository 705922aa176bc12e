"""Automatic checkpoints: save every N optimizer steps, resume once at start-up.

A save is due after the N-th optimizer step but is written just before the next batch is fetched (or the next
step begins, or the job closes): by then the user's loop has finished that step (``scheduler.step()``, logging,
anything else that touches state or draws random numbers), and nothing of the next step has happened yet. A job
resumed from it continues exactly where the uninterrupted one went on. An asynchronous save (:mod:`.background`) is
staged at that point and published at a later one, once written. A stop the ranks agreed on after a stop signal
(:mod:`paratrain.preemption`) is written at that same point, then the rank leaves.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from ..env import ClusterEnv
from ..errors import CheckpointError
from ..preemption import Note, Preempted, StopSignals
from . import io, layout
from .background import BackgroundSaves, check_support
from .config import CheckpointConfig


class AutoCheckpoint:
    """The checkpoints of one ``Parallel``: ``par.save``/``par.load`` where asked or in ``checkpoint_dir``, the
    save every N steps, the save on a stop signal, and the resume at start-up. ``say`` prints a line on rank 0."""

    def __init__(
        self,
        config: CheckpointConfig,
        say: Callable[[str], None] = print,
        timeout_s: float = 300.0,
        env: ClusterEnv | None = None,
    ) -> None:
        """``timeout_s``: how long the collectives of a background write wait for a peer. ``env``: where this process
        sits; a rank of a launched job catches its scheduler's stop signals (:mod:`paratrain.preemption`)."""
        if config.async_save:
            check_support()  # before any training, not at the first save
        self.config = config
        self._say = say
        self._background = BackgroundSaves(timeout_s)
        self._due = False
        self._stopping = False
        self.preempted = False
        """True once this rank saved on a stop signal and raised :class:`~paratrain.preemption.Preempted`."""
        main = env is None or env.is_main
        self.stop_signals = StopSignals(config.stop_check_every, saves=self.on, warn=_stderr if main else _silent)
        if env is not None and env.launched:
            self.stop_signals.install()
        self._started = False
        self._saved: tuple[Path, int] | None = None

    def root(self, path: str | os.PathLike | None) -> Path:
        """Where ``par.save``/``par.load`` go: ``path``, else ``checkpoint_dir``; neither is one line."""
        if path is None:
            if self.config.dir is None:
                raise CheckpointError(
                    "no checkpoint path given and no checkpoint directory set "
                    "(Parallel(checkpoint=DIR) or paratrain run --checkpoint-dir)"
                )
            path = self.config.dir
        return Path(path)

    @property
    def on(self) -> bool:
        """True when the job has a checkpoint folder of its own (``checkpoint_dir``): then every rank must stay."""
        return self.config.dir is not None

    def stepped(self, step: int, group: Callable[[], dist.ProcessGroup | None] = lambda: None) -> None:
        """Called after each optimizer step (``step`` counts them) on every rank of ``group()`` (those that train):
        marks a save as due every N steps, and the stop the ranks agree on after a stop signal. ``group`` is called
        only at a check (making a parameter server's workers' group is collective: not in a job that never checks)."""
        if self.config.every is not None and step % self.config.every == 0:
            self._due = True
        if self.stop_signals.agreed_on(step, group):
            self._stopping = True

    def flush(self, save: Callable[..., object], step: int, *, finishing: bool = False) -> None:
        """Publish a background save whose write is complete; write the due save (``par.save``, in the background
        when so configured), if any and unless an explicit ``par.save`` already wrote this step there. After an
        agreed stop: save this step, wait until it is published and raise :class:`~paratrain.preemption.Preempted`
        (``finishing``: the job closes anyway, so the save is merely due)."""
        self._background.poll()
        if self._stopping and not finishing:
            raise self._preempted(save, step)
        if self._due or self._stopping:
            self._due = self._stopping = False
            if self.config.dir is not None and self._saved != (Path(self.config.dir).absolute(), step):
                save(async_save=self.config.async_save)

    def _preempted(self, save: Callable[..., object], step: int) -> Preempted:
        """Write (or finish writing) the checkpoint of ``step`` and publish it, tell the launcher where (every rank
        alike, so that each node's launcher hears it), say it; the exception the rank leaves with."""
        root = Path(self.root(None))
        self._due = self._stopping = False
        if self._saved != (root.absolute(), step):
            save(async_save=False)
        self._background.finish()  # an explicit background save of this step
        self.stop_signals.uninstall()
        self.preempted = True
        stop = Preempted(step, root / layout.step_name(step))
        Note(step, str(stop.folder)).write()
        self._say(f"paratrain: {stop}")
        return stop

    def settle(self, barrier: Callable[[], None]) -> None:
        """Collective (``close``): wait until every rank's background save in flight is published."""
        self._background.settle(barrier)

    def close(self, barrier: Callable[[], None]) -> None:
        """Collective (``close``): ``settle``, then free the background saves' staging buffers; the stop signals
        are the script's again."""
        self.stop_signals.uninstall()
        self.settle(barrier)
        self._background.close()

    def wait_staged(self) -> None:
        """Return once the state of a background save in flight is copied: then it may change."""
        self._background.wait_staged()

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

    def save(
        self,
        targets: io.Targets,
        path: str | os.PathLike | None,
        micro_step: int,
        accumulate: int,
        async_save: bool = False,
    ) -> Path:
        """Write ``targets`` into ``path`` (else ``checkpoint_dir``), after the save in flight; ``async_save``: in
        the background. Refused inside an accumulation window."""
        if micro_step != 0:
            raise CheckpointError(
                f"save() inside an accumulation window (micro-step {micro_step} of {accumulate}); "
                "call it after the optimizer step"
            )
        root = self.root(path)
        if async_save:
            folder = self._background.start(targets, root, self.config.keep)
        else:
            self._background.finish()
            folder = io.save(targets, root, self.config.keep)
        self.saved(root, targets.step)
        return folder

    def load(self, targets: io.Targets, path: str | os.PathLike | None) -> io.Position:
        """Restore ``targets`` from ``path`` (a ``step-…`` folder or a root's latest), once the save in flight is
        published, and say what was loaded."""
        self._background.settle(targets.barrier)
        position = io.load(targets, self.root(path))
        self.loaded()
        if not targets.optimizers:
            self._say(f"paratrain: loaded the model weights of {position.folder} (no optimizer was prepared)")
            return position
        where = f", epoch {position.epoch}" if position.epoch is not None else ""
        moved = f", saved by {position.world_size} process(es)" if position.world_size != targets.world_size else ""
        self._say(f"paratrain: resumed from {position.folder} (step {position.step}{where}{moved})")
        return position

    def to_resume(self) -> Path | None:
        """The checkpoint start-up resumes from, once, if the job is set to resume and one exists."""
        if not self.wants_resume():
            return None
        found = self.start()
        if found is None:
            self._say(f"paratrain: no checkpoint in {self.config.dir} yet; starting from the beginning")
        return found


def _stderr(line: str) -> None:
    """A line written at once, safe inside a signal handler (``print`` is not: it may interrupt a ``print``)."""
    os.write(2, f"{line}\n".encode())


def _silent(line: str) -> None:
    """Where other ranks' copies of rank 0's warnings go."""
