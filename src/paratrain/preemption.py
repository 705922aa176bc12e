"""Saves on preemption: SIGTERM or SIGUSR1 makes every rank finish its step, save, and exit restartable.

A scheduler that takes the machines back warns first: SLURM sends ``--signal=USR1@SECONDS`` before the time limit,
Kubernetes sends SIGTERM and waits ``terminationGracePeriodSeconds``, and ``paratrain run`` forwards what it gets to
its ranks. A rank only notes the signal (:class:`StopSignals`); the ranks then agree on the step at which they stop,
write the job's checkpoint there, and leave with exit code 75 (:data:`PREEMPTED_EXIT_CODE`, ``EX_TEMPFAIL`` of
sysexits.h): ``--max-restarts`` restarts on it as on any failure, ``paratrain run`` ends with it too, and the job
files of ``paratrain slurm`` and ``paratrain k8s`` requeue or restart on it.

Why an agreement, and why every ``k`` steps: a signal reaches the ranks at different moments, maybe in different
steps, and a checkpoint is a collective that every rank must enter at the same step. So every ``k``-th optimizer step
(``CheckpointConfig(stop_check_every=k)``, default :data:`DEFAULT_CHECK_EVERY`) the ranks take the maximum of their
flags in one tiny all-reduce: all of them see the same answer at the same step. Each check costs one round trip
of a few bytes; on a group with gloo for host tensors the flag travels as a host tensor (no wait for the GPU at
all), on an NCCL-only group as a device tensor, whose read waits for the GPU's queue once per ``k`` steps. No step
between two checks communicates or waits for anything more than it did. The price is latency: a rank stops at most
``k`` steps after the signal, so the grace period must cover ``k`` steps and a save.

Without a checkpoint directory there is nothing to save: the first such signal prints one warning and the rank ends
as it would have without paratrain (the handler that was there before, or the signal's default action).

Which signals a rank catches: a Python handler runs only once the main thread is back in the interpreter, so a rank
blocked in a collective whose peer died would not end on a launcher's SIGTERM until the launcher's kill, seconds
later. Where a paratrain launcher started the rank, SIGTERM is that launcher's teardown and is left alone: ``paratrain
run`` hands a stop it gets (SIGTERM or SIGUSR1) to its ranks as SIGUSR1 (:func:`ask_to_stop` first), and
``paratrain.launch`` stops its ranks with SIGTERM. A rank started by torchrun or ``srun`` alone, whose scheduler's
SIGTERM is the warning, catches both (:func:`caught_signals`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from .errors import PREEMPTED_EXIT_CODE

if TYPE_CHECKING:  # torch is imported where used: the launcher imports this module before torch, on purpose
    import torch
    import torch.distributed as dist

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "Note",
    "Preempted",
    "StopSignals",
    "any_rank",
    "ask_to_stop",
    "caught_signals",
    "flag_device",
    "stop_asked",
]
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
SPAWNED_VAR = "PARATRAIN_SPAWNED"
"""Set in the ranks of ``paratrain.launch``, whose SIGTERM ends them."""
DEFAULT_CHECK_EVERY = 10
"""Optimizer steps between two checks: one tiny collective per ten steps, a stop at most ten steps late."""
NOTE_VAR = "PARATRAIN_PREEMPT_NOTE"
"""A file ``paratrain run`` names for its ranks: they write where they saved into it (a :class:`Note`)."""


class Preempted(SystemExit):
    """Raised on every rank once it has saved at the agreed step: the rank ends with :data:`PREEMPTED_EXIT_CODE`."""

    def __init__(self, step: int, folder: Path) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step, self.folder = step, folder

    def __str__(self) -> str:
        return f"preempted at step {self.step}, saved to {self.folder}"


@dataclass(frozen=True)
class Note:
    """What a preempted rank tells its launcher: the step it stopped at and the checkpoint it wrote."""

    step: int
    folder: str

    def write(self, environ: Mapping[str, str] | None = None) -> None:
        """Into the launcher's file, when there is one (atomically: the launcher may read it at any moment; a
        launcher already gone is no reason to fail a rank that saved)."""
        path = (os.environ if environ is None else environ).get(NOTE_VAR)
        if not path:
            return
        tmp = f"{path}.{os.getpid()}"
        with contextlib.suppress(OSError):
            with open(tmp, "w") as f:
                json.dump({"step": self.step, "folder": self.folder}, f)
            os.replace(tmp, path)

    @classmethod
    def read(cls, path: str | os.PathLike) -> Note | None:
        """The note a rank wrote into ``path``, or None."""
        try:
            data: dict[str, Any] = json.loads(Path(path).read_text())
            return cls(int(data["step"]), str(data["folder"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None


def ask_to_stop(note: str) -> None:
    """In the launcher, before it forwards a stop signal: its ranks' SIGTERM is a stop to save on."""
    Path(f"{note}.stop").touch()


def stop_asked(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this job's ``paratrain run`` has asked its ranks to stop (:func:`ask_to_stop`)."""
    note = (os.environ if environ is None else environ).get(NOTE_VAR)
    return bool(note) and os.path.exists(f"{note}.stop")


def caught_signals(environ: Mapping[str, str]) -> tuple[signal.Signals, ...]:
    """The stop signals a rank catches: SIGUSR1 alone where a paratrain launcher started it (``paratrain run``'s
    note, ``paratrain.launch``'s mark: there SIGTERM ends a rank at once), both under torchrun or ``srun``."""
    if environ.get(NOTE_VAR) or environ.get(SPAWNED_VAR):
        return (signal.SIGUSR1,)
    return STOP_SIGNALS


def any_rank(flag: bool, group: dist.ProcessGroup | None) -> bool:
    """Whether ``flag`` is True on any rank of ``group`` (collective; ``flag`` itself without a process group)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) < 2:
        return flag
    t = torch.tensor(int(flag), dtype=torch.int32, device=flag_device(dist.get_backend_config(group)))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def flag_device(backend_config: str) -> torch.device:
    """Where the flag travels on a group of ``backend_config`` (``dist.get_backend_config``): the host where the
    group has gloo (``gloo``, ``cpu:gloo,cuda:nccl``), so nobody waits for a GPU; an NCCL-only group refuses host
    tensors, so there on the rank's current device, which ``Parallel`` claimed for it before the group started."""
    import torch

    if "gloo" in backend_config:
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


class StopSignals:
    """SIGTERM and SIGUSR1 of one rank, noted while training runs; :meth:`agreed` says when every rank stops."""

    def __init__(self, every: int, saves: bool, warn: Callable[[str], None]) -> None:
        """``every``: optimizer steps between checks; ``saves``: the job has a checkpoint directory to save into;
        ``warn``: where the one warning goes when it has none."""
        self.every, self.saves, self._warn = every, saves, warn
        self.received: signal.Signals | None = None
        """The first stop signal this rank got."""
        self._previous: dict[signal.Signals, Any] = {}
        self._pid = os.getpid()

    def install(self) -> None:
        """Catch the stop signals from now on (in the main thread, where Python runs handlers; once). Processes
        forked later (a DataLoader's workers) inherit the handler: SLURM signals them too, and a loader worker
        that died of it would end its rank before the save."""
        if self._previous or threading.current_thread() is not threading.main_thread():
            return
        self._pid = os.getpid()
        self._previous = {sig: signal.signal(sig, self._handle) for sig in caught_signals(os.environ)}

    def uninstall(self) -> None:
        """Give the stop signals back to the handlers they had before :meth:`install`."""
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    def agreed(self, step: int, meet: Callable[[bool], bool]) -> bool:
        """After optimizer step ``step``: True on every rank alike when the ranks stop here. Every ``every``-th step
        only, and then collectively: ``meet(flag)`` (:func:`any_rank`) is True when some rank's flag is."""
        if not self.saves or step % self.every:
            return False
        return meet(self.received is not None)

    def agreed_on(self, step: int, group: Callable[[], dist.ProcessGroup | None]) -> bool:
        """:meth:`agreed` among the ranks of ``group()`` (asked only at a check), whose flags travel as
        :func:`flag_device` says."""
        return self.agreed(step, lambda flag: any_rank(flag, group()))

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if self.saves:
            self.received = self.received or sig
        else:
            if os.getpid() == self._pid:  # the rank itself, not a process it forked
                self._warn(
                    "paratrain: warning: asked to stop (SIGTERM or SIGUSR1) but the job has no checkpoint directory "
                    "(Parallel(checkpoint=DIR) or paratrain run --checkpoint-dir): stopping without a save"
                )
            self._as_before(sig, frame)

    def _as_before(self, sig: signal.Signals, frame: FrameType | None) -> None:
        """What ``sig`` did before :meth:`install`: the handler there was, or the signal's default action."""
        before = self._previous.get(sig, signal.SIG_DFL)
        self.uninstall()
        if callable(before):
            before(int(sig), frame)
        elif before == signal.SIG_DFL:
            os.kill(os.getpid(), sig)  # the default action, now that the default is back
