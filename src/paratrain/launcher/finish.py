"""How a worker ends once the user's script is over: with the script's exit code, never a crash at teardown.

A script that returns normally is a success. Plain interpreter exit broke that in 1 of 7 to 1 of 3 runs at world 2
on gloo (``benchmarks/RESULTS.md`` §15), under torchrun as under ``paratrain run``, with or without
``destroy_process_group()``:
a gloo worker thread that drops the last reference to a finished collective (``AsyncWork``, whose thread-local
state holds a Python object) needs the GIL for it; once the interpreter is finalizing, that thread is ended by
a forced unwind through a C++ destructor, and the process dies of ``terminate called without an active
exception`` (SIGABRT), or of a SIGSEGV. A job that had finished was reported failed, and with ``--max-restarts``
run again.

So the worker (and each rank ``paratrain.launch`` spawns) ends this way: it waits for the script's non-daemon
threads (as the interpreter would), runs the ``atexit`` handlers (the user's too), flushes the standard streams
and calls ``os._exit`` with the script's exit code, skipping the finalization that aborts. Nothing of torch is
torn down: the process groups, their threads and sockets end with the process (a peer sees the connection
close, as it does when a rank exits normally). Destroying the groups first is not needed to avoid the abort
(0 of 100 runs aborted without it), and it is the call reported to wait forever in gloo's destructor.

What can still hang is the user's own exit code: an ``atexit`` handler, or a ``destroy_process_group()`` in one
that waits in gloo's destructor. Once the script is over and its threads are done, a daemon thread allows
``PARATRAIN_EXIT_TIMEOUT`` seconds (default 30) for the rest; past that it prints
``paratrain: rank N finished, then stuck at exit for 30 s; ended it`` and ends the process with the script's exit
code: a finished job stays a success and is never restarted. (A handler that blocks while it holds the GIL
would stop that thread too; torch releases it in blocking calls and before destroying a process group.)
"""

from __future__ import annotations

import atexit
import gc
import io
import os
import sys
import threading
import time
from collections.abc import Mapping
from typing import NoReturn

EXIT_TIMEOUT_VAR = "PARATRAIN_EXIT_TIMEOUT"
DEFAULT_EXIT_TIMEOUT_S = 30.0
"""Long enough for atexit handlers that flush logs or close files, short of leaving a finished job running."""


def exit_timeout(environ: Mapping[str, str] | None = None) -> float:
    """Seconds a finished worker may spend in its exit handlers (``PARATRAIN_EXIT_TIMEOUT``, default 30)."""
    env = os.environ if environ is None else environ
    try:
        seconds = float(env.get(EXIT_TIMEOUT_VAR) or DEFAULT_EXIT_TIMEOUT_S)
    except ValueError:
        seconds = DEFAULT_EXIT_TIMEOUT_S
    return seconds if seconds > 0 else DEFAULT_EXIT_TIMEOUT_S


def exit_code(code: object) -> int:
    """The process exit code of ``SystemExit(code)``, as the interpreter computes it (it prints a message code)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def leave(code: int, environ: Mapping[str, str] | None = None) -> NoReturn:
    """End this worker with ``code`` as the interpreter would, less its finalization (see the module docstring)."""
    _wait_for_threads()
    _flush()  # what the script printed, before a handler can hang
    _start_watchdog(code, exit_timeout(environ), os.environ.get("RANK", "?"))
    try:
        atexit._run_exitfuncs()  # exceptions in handlers are printed there, as at a normal exit
    finally:
        _flush_open_files()
        _flush()
        os._exit(code)


def _wait_for_threads() -> None:
    """What the interpreter does first at exit: join the non-daemon threads (``concurrent.futures`` pools too)."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()


def _start_watchdog(code: int, seconds: float, rank: str) -> None:
    def watch() -> None:
        time.sleep(seconds)
        what = "finished" if code == 0 else f"ended with exit code {code}"
        message = f"paratrain: rank {rank} {what}, then stuck at exit for {seconds:g} s; ended it\n"
        try:
            os.write(2, message.encode())  # not sys.stderr: a stuck handler may hold its lock
            _flush_open_files()
        finally:
            os._exit(code)

    try:
        threading.Thread(target=watch, name="paratrain-exit-watchdog", daemon=True).start()
    except RuntimeError:  # no new threads at this point of an interpreter's life: end without the bound
        pass


_FILE_TYPES = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)


def _flush_open_files() -> None:
    """Flush the files the script left open (``print(..., file=open(path, "a"))``): the interpreter's finalization
    would have, as it freed them; ``os._exit`` does not, and what was buffered would be lost."""
    for obj in gc.get_objects():
        if type(obj) in _FILE_TYPES:
            try:
                if not obj.closed:
                    obj.flush()
            except (OSError, ValueError):  # a pipe whose reader is gone, a file closed under it
                pass


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed or replaced by the script
            pass
