"""``paratrain dry-run``: lay a model out as ``prepare`` would, as every rank of a world of any size, in this one
CPU process, in seconds; print what each rank holds, or the error a launch would hit.

Examples:
  paratrain dry-run --world 128 --strategy zero3 --tp 8 --model-config ./Llama-3-8B/config.json
  paratrain dry-run --world 64 --strategy pipeline --model gpt2 --json

The model is built on the meta device and wrapped by the strategy's own code over PyTorch's fake process group:
nothing is allocated, nothing is launched. Exit code 1 when the layout fails as a launch would.
See docs/large-models.md.
"""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return sub.add_parser(
        "dry-run",
        help="lay a model out as every rank of a world of N would, without a launch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..dry_run.command import DryRunConfig
    from ..flags import add_flags

    add_flags(p, DryRunConfig)


def execute(args: argparse.Namespace) -> int:
    from ..dry_run.command import DryRunConfig, run_dry_run
    from ..flags import build

    return run_dry_run(build(DryRunConfig, args))
