"""``paratrain run``: torchrun-compatible launcher (see :mod:`paratrain.launch.torchrun`)."""
from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", add_help=False, help="launch a script on N processes (torchrun flags)",
                       description="torchrun-compatible launcher; `paratrain run --help` lists every flag")
    p.add_argument("argv", nargs=argparse.REMAINDER)


def execute(args: argparse.Namespace) -> int:
    from ..launch.torchrun import run

    run(args.argv, quiet_agent=not args.debug)
    return 0
