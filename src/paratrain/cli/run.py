"""``paratrain run``: torchrun-compatible launcher (see :mod:`paratrain.launch.torchrun`)."""
from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", add_help=False, help="launch a script on N processes (torchrun flags)",
                       description="torchrun-compatible launcher; `paratrain run --help` lists every flag")
    p.add_argument("argv", nargs=argparse.REMAINDER)


def execute(args: argparse.Namespace) -> int:
    from ..launch.torchrun import run

    if "--tf" in args.argv:  # unless it is the script's own flag: then a torch job after all
        from ..tf.launcher import run as run_tf

        if run_tf(args.argv, debug=args.debug):
            return 0
    run(args.argv, quiet_agent=not args.debug)
    return 0
