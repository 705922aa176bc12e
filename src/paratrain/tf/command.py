"""The TensorFlow extra's one entry from the CLI: ``paratrain.cli.main`` hands every command parsed with ``--tf``
(run, demo, bench, verify) here, whole; the torch side of each command never looks for TensorFlow."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from ..errors import ConfigError


def execute(args: argparse.Namespace) -> int:
    """Run the TensorFlow form of ``args.command``; the exit code."""
    return COMMANDS[args.command](args)


def _run(args: argparse.Namespace) -> int:
    from .launcher import launch

    launch(args.launch, debug=args.debug)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from ..demo.config import DemoConfig
    from ..flags import build
    from .demo import run_demo

    return run_demo(build(DemoConfig, args))


def _bench(args: argparse.Namespace) -> int:
    from .bench import bench_tf, format_tf_report

    try:
        nprocs = tuple(int(n) for n in (args.nproc or "1,2").split(","))
    except ValueError:
        raise ConfigError(f"--nproc must be world sizes like 1,2, got {args.nproc!r}") from None
    print(
        format_tf_report(
            bench_tf(
                nprocs=nprocs,
                batch=args.batch,
                steps=args.steps,
                warmup=args.warmup,
                rounds=args.rounds,
                json_path=args.json,
                plot_path=args.plot,
                plot=not args.no_plot,
            )
        )
    )
    return 0


def _verify(args: argparse.Namespace) -> int:
    from .verify import DEFAULT_TOLERANCE, verify_tf

    result = verify_tf(
        nproc=args.nproc,
        steps=args.steps or 5,
        tolerance=args.tolerance or DEFAULT_TOLERANCE,
        mistake=args.tf_mistake,
        factory=args.factory,
    )
    print(result.report())
    return 0 if result.passed else 1


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": _run,
    "demo": _demo,
    "bench": _bench,
    "verify": _verify,
}
"""The commands that take ``--tf``."""
