"""paratrain's exceptions.

Every error a user can cause is a :class:`ParatrainError` whose message is one line saying what is wrong and
how to fix it. The CLI prints that line without a traceback (``--debug`` shows it).
"""

from __future__ import annotations

import re


class ParatrainError(Exception):
    """Base class: a problem the user can fix, described in one line."""


class ConfigError(ParatrainError, ValueError):
    """An invalid option or combination of options."""


class UnknownStrategyError(ConfigError):
    """A strategy name that is not registered."""


class LaunchError(ParatrainError):
    """A job could not be started (bad script, taken port, bad process count)."""


class RankFailedError(LaunchError):
    """A rank of a running job failed; the job was stopped.

    Carries the root cause so callers (and the CLI) can lead with it.
    """

    def __init__(
        self,
        rank: int,
        exitcode: int,
        host: str,
        pid: int | None,
        traceback: str | None,
        ranks: tuple[int, ...] = (),
        stopped: tuple[int, ...] = (),
        stopped_by: str = "SIGTERM",
    ) -> None:
        self.rank = rank
        self.ranks = ranks or (rank,)
        """Every rank that failed with the same error (the root cause's rank first)."""
        self.stopped = stopped
        """Ranks the launcher stopped because this one failed: not failures of their own."""
        self.stopped_by = stopped_by
        """How the launcher stopped them (torchrun's agent: SIGTERM; TensorFlow's workers ignore it)."""
        self.exitcode = exitcode
        self.host = host
        self.pid = pid
        self.traceback = traceback
        cause = _last_line(traceback)
        super().__init__(
            f"rank {rank} failed on {host} ({describe_exitcode(exitcode)}"
            f"{': ' + cause if cause else ''}); the job was stopped"
        )
        if traceback:  # shown under an uncaught error in Python; the CLI prints its own report
            self.add_note(f"traceback of rank {rank}:\n{traceback.rstrip()}")


class JobTimeoutError(LaunchError):
    """A job ran past its deadline and was stopped."""


class JobInterrupted(LaunchError):
    """The launcher got SIGINT or SIGTERM and stopped every rank.

    ``exit_code`` is the shell's convention for a process ended by that signal: 128 + its number (130, 143).
    """

    def __init__(self, sig: int, ranks: int, seconds: float, left: int = 0) -> None:
        import signal

        self.signal = signal.Signals(sig)
        self.ranks, self.seconds, self.left = ranks, seconds, left
        self.exit_code = 128 + int(self.signal)
        still = f"; {left} still running" if left else ""
        super().__init__(
            f"interrupted ({self.signal.name}), {ranks} rank{'s' if ranks != 1 else ''} stopped in "
            f"{seconds:.1f} s{still}"
        )


PREEMPTED_EXIT_CODE = 75
"""``EX_TEMPFAIL`` of sysexits.h ("temporary failure; the user is invited to retry"): what a rank that saved on a stop
signal exits with, and ``paratrain run`` after it (:mod:`paratrain.preemption`)."""


class JobPreempted(LaunchError):
    """Every rank saved at the step they agreed on after a stop signal and exited restartable (``exit_code`` 75)."""

    def __init__(self, step: int, folder: str, signal: str | None = None) -> None:
        self.step, self.folder = step, folder
        self.exit_code = PREEMPTED_EXIT_CODE
        got = f" ({signal})" if signal else ""
        super().__init__(
            f"preempted{got} at step {step}, saved to {folder}; exit code {PREEMPTED_EXIT_CODE}: restart the job "
            "to resume from there"
        )


class CollectiveError(ParatrainError):
    """Ranks that did not meet in a collective: one left early, or they called different things."""


class CheckpointError(ParatrainError):
    """A checkpoint that cannot be written or loaded: missing, damaged, unsafe, or from another model."""


_EXCEPTION_LINE = re.compile(r"[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Iteration|Failure)(: |:?$)")


def _last_line(text: str | None) -> str:
    """The traceback's last exception line ("ValueError: …"), with the first line of its message when the message
    starts on a line of its own (pipelining's stage errors do); else the last line."""
    lines = [line.rstrip() for line in (text or "").splitlines() if line.strip()]
    for i in range(len(lines) - 1, -1, -1):
        if _EXCEPTION_LINE.match(lines[i]):
            line = lines[i]
            if line.endswith(":") and i + 1 < len(lines):
                line = f"{line} {lines[i + 1].strip()}"
            return line[:200]
    return lines[-1].strip()[:200] if lines else ""


def describe_exitcode(exitcode: int) -> str:
    """'exit code 1' or 'killed by SIGKILL' for a negative (signal) exit code."""
    if exitcode < 0:
        import signal

        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"
