"""``paratrain demo``: train a small CNN on scikit-learn's handwritten digits across N processes (2 on a CPU, every
GPU when present) and report accuracy, time and throughput.

Examples:
  paratrain demo
  paratrain demo -n 4 --strategy zero3 --epochs 5
  paratrain demo --checkpoint-dir ckpt --checkpoint-every 20 --max-restarts 1 --fail-at-step 30 --fail-rank 1
  paratrain demo --tf                        # the TensorFlow demo: a Keras CNN (needs paratrain[tf])

Each process runs ``python -m paratrain.demo`` with the same options (``paratrain.demo.config.DemoConfig``).
"""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return sub.add_parser(
        "demo",
        help="train a CNN on the bundled handwritten digits",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..demo.config import DemoConfig
    from ..flags import add_flags

    add_flags(p, DemoConfig)
    p.add_argument(
        "--tf",
        action="store_true",
        help="the TensorFlow demo: a Keras CNN under MultiWorkerMirroredStrategy (needs paratrain[tf]; "
        "--fail-at-step then counts epochs)",
    )


def execute(args: argparse.Namespace) -> int:
    from ..demo.command import run_demo
    from ..demo.config import DemoConfig
    from ..flags import build

    return run_demo(build(DemoConfig, args))
