"""Runs the user's script or module inside each torchrun worker.

``paratrain run`` starts ``python -m paratrain.launcher.worker [-m] TARGET ARGS…`` instead of the target itself (with
``--no-python``, ``… --exec PROGRAM ARGS…``, which asks for the parent-death signal and then becomes the program), so
that:

* the worker dies with the launcher, even when the launcher is SIGKILLed (:mod:`paratrain.launcher.parent_death`);
* an exception is recorded for the launcher (torchelastic's error file, as ``@record`` does) and *not* printed
  here: the launcher shows one report for the whole job, instead of one traceback per rank
  (``paratrain --debug run`` prints them all again);
* the script's end is the worker's end: its exit code, after its ``atexit`` handlers, without the interpreter
  finalization that gloo's threads can abort, and at most ``PARATRAIN_EXIT_TIMEOUT`` seconds stuck in those
  handlers (:mod:`paratrain.launcher.finish`);
* no faulthandler dump of every thread when a rank dies of a signal, unless ``paratrain --debug run``;
* the default process-group timeout is bounded (:mod:`paratrain.launcher.pg_timeout`) and the nodes of a multi-node
  job check that they agree (:mod:`paratrain.launcher.agreement`);
* every rank dumps its flight-recorder trace when any rank's collective stalls, and a rank whose collective timed
  out or lost its peer asks for them before it fails (:mod:`paratrain.hang_trace`).

The target runs as ``__main__`` with its own ``sys.argv`` and ``sys.path[0]``, exactly as ``python TARGET`` or
``python -m TARGET`` would run it.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback

from paratrain.call_watch import collective_stalled
from paratrain.hang_trace import TraceDumps
from paratrain.launcher.agreement import check_same_nnodes
from paratrain.launcher.finish import exit_code, leave
from paratrain.launcher.parent_death import die_with_parent, launcher_pid
from paratrain.launcher.pg_timeout import apply_default_pg_timeout
from paratrain.launcher.signals import restore_worker_signals

DEBUG_VAR = "PARATRAIN_DEBUG"
"""Set by ``paratrain --debug run``: every rank prints its own traceback as well."""


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    argv = sys.argv[1:] if argv is None else argv
    die_with_parent(launcher_pid())
    restore_worker_signals()
    if argv and argv[0] == "--exec":  # paratrain run --no-python: the kernel's parent-death request survives exec
        _exec(argv[1:])
    errors = get_error_handler()
    debug = bool(os.environ.get(DEBUG_VAR))
    if debug:  # torchelastic's handler enables faulthandler: a dump of every thread on each signal exit
        errors.initialize()
    dumps = TraceDumps.from_environ()
    if dumps is not None:
        dumps.start()
    try:
        apply_default_pg_timeout()
        check_same_nnodes()
        run_target(argv)
    except SystemExit as e:
        _dump(dumps)
        leave(exit_code(e.code))
    except BaseException as e:  # noqa: BLE001 - recorded for the launcher, which reports it once
        if dumps is not None and collective_stalled(e):
            dumps.request()
        errors.record_exception(e)
        if debug:
            traceback.print_exc()
        leave(1)
    _dump(dumps)
    leave(0)


def _dump(dumps: TraceDumps | None) -> None:
    """A rank that ends writes its trace: peers that still wait in a collective it never made fail next, and the
    report says what this rank completed last."""
    if dumps is not None:
        dumps.dump(stacks=False)


def _exec(argv: list[str]) -> None:
    """Become ``argv``'s program (``paratrain run --no-python``), or say in one line why it cannot run."""
    sys.stdout.flush()
    try:
        os.execvp(argv[0], argv)
    except OSError as err:
        sys.stderr.write(f"paratrain run --no-python: cannot run {argv[0]!r}: {err.strerror}\n")
        os._exit(127)


def run_target(argv: list[str]) -> None:
    """Run ``argv`` (``SCRIPT ARGS…`` or ``-m MODULE ARGS…``) as ``python`` would: as ``__main__``, with its own
    ``sys.argv`` and ``sys.path[0]``."""
    if argv and argv[0] == "-m":
        module, rest = argv[1], argv[2:]
        sys.argv = [module, *rest]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script = os.path.abspath(argv[0])  # __file__ absolute, as python (3.9+) and torchrun give it
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(script)
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
