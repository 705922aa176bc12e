"""Runs the user's script or module inside each torchrun worker.

``paratrain run`` starts ``python -m paratrain.launch.worker [-m] TARGET ARGS…`` instead of the target itself, so
that an exception is recorded (torchelastic's ``@record``) and the launcher can show the failing rank's
traceback first. Before the target runs, the default process-group timeout is bounded
(:mod:`paratrain.launch.pg_timeout`) and the nodes of a multi-node job check that they agree
(:mod:`paratrain.launch.agreement`). The target runs as ``__main__`` with its own ``sys.argv`` and
``sys.path[0]``, exactly as ``python TARGET`` or ``python -m TARGET`` would run it.
"""
from __future__ import annotations

import os
import runpy
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from paratrain.launch.agreement import check_same_nnodes
from paratrain.launch.pg_timeout import apply_default_pg_timeout


@record
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    apply_default_pg_timeout()
    check_same_nnodes()
    if argv and argv[0] == "-m":
        module, rest = argv[1], argv[2:]
        sys.argv = [module, *rest]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script = argv[0]
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
