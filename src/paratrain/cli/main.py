"""paratrain — run PyTorch training on many processes, GPUs and nodes.

Commands:
  paratrain run [-n N] [torchrun flags…] script.py [args…]   launch a script on N processes per node
  paratrain demo [-n N] [--strategy S] [--epochs E]          train a CNN on the bundled digits data
  paratrain plan --model gpt2-medium --gpus 8 --gpu h100    memory per GPU and step time of every strategy
  paratrain doctor [--json] [--skip-bandwidth]              check the environment, measure all-reduce bandwidth
  paratrain bench [--workload W] [-n 1,2] [--compare torch-ddp]  speedup, efficiency and their causes, measured
  paratrain verify module:factory [--strategy S] [-n N]     does the parallel run equal one process?
  paratrain slurm --nodes 4 --gpus-per-node 8 train.py      write an sbatch script (srun paratrain run …)
  paratrain export CKPT OUT.pt                              a checkpoint's model as one plain state_dict file

Errors print one line; add --debug (before the command) for the full traceback.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from ..errors import JobInterrupted, ParatrainError, RankFailedError
from . import bench, demo, doctor, export, plan, run, slurm, verify

COMMANDS = {"run": run, "demo": demo, "doctor": doctor, "plan": plan, "bench": bench, "verify": verify,
            "slurm": slurm, "export": export}


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line pointing at ``--help`` instead of the whole usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="paratrain", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show full tracebacks")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    for name, module in COMMANDS.items():
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # argparse's REMAINDER drops leading options of a sub-command; hand `run`'s arguments over untouched.
    head = 0
    while head < len(argv) and argv[head] == "--debug":
        head += 1
    if head < len(argv) and argv[head] == "run":
        args = parser.parse_args([*argv[:head], "run"])
        args.argv = argv[head + 1:]
    else:
        args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return COMMANDS[args.command].execute(args)
    except JobInterrupted as err:
        print(f"paratrain: {err}", file=sys.stderr)
        return err.exit_code
    except RankFailedError as err:
        if args.debug:
            raise
        from ..launch.failure import format_failure

        print(format_failure(err), file=sys.stderr)
        return 1
    except ParatrainError as err:
        if args.debug:
            raise
        print(f"paratrain: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("paratrain: interrupted", file=sys.stderr)
        return 130


def _version() -> str:
    from ..version import __version__

    return f"paratrain {__version__}"
