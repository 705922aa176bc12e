"""``paratrain run``: torchrun-compatible launcher (see :mod:`paratrain.launcher.torchrun`); with ``--tf`` before the
script, TensorFlow's (:mod:`paratrain.tf.launcher`)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return sub.add_parser(
        "run",
        add_help=False,
        help="launch a script on N processes (torchrun flags)",
        description="torchrun-compatible launcher; `paratrain run --help` lists every flag",
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("argv", nargs=argparse.REMAINDER)


def parse_launch(args: argparse.Namespace) -> None:
    """The launcher's own flags, parsed by its parser: a ``--tf`` after the script is the script's."""
    from ..launcher.torchrun import parse_launch

    args.launch = parse_launch(args.argv, quiet_agent=not args.debug)
    args.tf = args.launch.tf


def execute(args: argparse.Namespace) -> int:
    from ..launcher.torchrun import launch

    launch(args.launch, quiet_agent=not args.debug)
    return 0
