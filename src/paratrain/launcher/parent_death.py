"""Workers die with the process that launched them, however it dies.

A SIGKILL of ``paratrain run`` (an out-of-memory killer, a scheduler, ``kill -9``) skips every ``finally`` and
signal handler of the launcher: its workers would be re-parented to init and train on, indefinitely, competing
with a resubmitted job. Linux's ``PR_SET_PDEATHSIG`` has the kernel send a signal to a process when its parent
*thread* exits. torchrun's agent starts its workers from the launcher's main thread (``subprocess.Popen`` in
``PContext.start``), and ``paratrain.launch`` from the calling thread, so the signal comes when the launcher itself
ends. On other systems this does nothing.
"""

from __future__ import annotations

import os
import signal
import sys

LAUNCHER_PID_VAR = "PARATRAIN_LAUNCHER_PID"
"""The pid of ``paratrain run``, exported to its workers so each can ask to die with it."""
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int | None, sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies; exit at once if ``parent`` (the pid
    this process was started by) is already gone. Returns whether the request was made (Linux only)."""
    if parent is None or not sys.platform.startswith("linux"):
        return False
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig)) != 0:
        return False
    if os.getppid() != parent:  # the parent died before the request took effect: nobody would signal us
        os._exit(1)
    return True


def launcher_pid(environ: dict[str, str] | None = None) -> int | None:
    """The launcher's pid as ``paratrain run`` exported it, or None outside ``paratrain run``."""
    value = (os.environ if environ is None else environ).get(LAUNCHER_PID_VAR, "")
    return int(value) if value.isdigit() else None
