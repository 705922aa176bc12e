"""paratrain — run PyTorch training on many processes, GPUs and nodes.

Commands:
  paratrain run [-n N] [torchrun flags…] script.py [args…]   launch a script on N processes per node
  paratrain demo [-n N] [--strategy S] [--epochs E]          train a CNN on the bundled digits data
  paratrain plan --model gpt2-medium --gpus 8 --gpu h100    memory per GPU and step time of every strategy
  paratrain tp-plan --model M --tp N [--auto]               the tensor-parallel plan a model gets at degree N
  paratrain dry-run --world N --strategy S --model M        lay a model out as N ranks would, in one process
  paratrain doctor [--json] [--skip-bandwidth]              check the environment, measure all-reduce bandwidth
  paratrain bench [--workload W] [-n 1,2] [--compare torch-ddp]  speedup, efficiency and their causes, measured
  paratrain verify module:factory [--strategy S] [-n N]     does the parallel run equal one process?
  paratrain verify train.py [ARGS] [--strategy S] [-n N]    the same for an unchanged script, its first K steps
  paratrain slurm --nodes 4 --gpus-per-node 8 train.py      write an sbatch script (srun paratrain run …)
  paratrain k8s --image I --nodes 4 --gpus-per-node 8 train.py   write a Kubeflow Trainer TrainJob manifest
  paratrain export CKPT OUT.pt                              a checkpoint's model as one plain state_dict file
  paratrain export --format hf CKPT OUT/                    … or as a Hugging Face folder (from_pretrained)

run, demo, bench and verify take --tf: the same command for TensorFlow (Keras tf.distribute; paratrain[tf]).
Errors print one line; add --debug (before the command) for the full traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from ..errors import JobInterrupted, JobPreempted, ParatrainError, RankFailedError
from . import bench, demo, doctor, dry_run, export, k8s, plan, run, slurm, tp_plan, verify

COMMANDS = {
    "run": run,
    "demo": demo,
    "plan": plan,
    "tp-plan": tp_plan,
    "dry-run": dry_run,
    "doctor": doctor,
    "bench": bench,
    "verify": verify,
    "slurm": slurm,
    "k8s": k8s,
    "export": export,
}


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line pointing at ``--help`` instead of the whole usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The CLI's parser, with the flags of ``command`` alone: a command's flags come from its config, whose module
    most often imports torch, and ``paratrain run`` imports torch its own way (quietly, for its launcher)."""
    parser = OneLineParser(prog="paratrain", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show full tracebacks")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    for name, module in COMMANDS.items():
        p = module.add_parser(sub)
        if name == command:
            module.add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    if args.command is None:
        build_parser().print_help()
        return 2
    try:
        return _execute(args)
    except (JobInterrupted, JobPreempted) as err:
        print(f"paratrain: {err}", file=sys.stderr)
        return err.exit_code
    except RankFailedError as err:
        if args.debug:
            raise
        from ..launcher.failure import format_failure

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


def _parse(argv: list[str]) -> argparse.Namespace:
    head = 0
    while head < len(argv) and argv[head] == "--debug":
        head += 1
    command = argv[head] if head < len(argv) else None
    parser = build_parser(command)
    if command != "run":
        return parser.parse_args(argv)
    # argparse's REMAINDER drops leading options of a sub-command; hand `run`'s arguments over untouched.
    args = parser.parse_args([*argv[:head], "run"])
    args.argv = argv[head + 1 :]
    return args


def _execute(args: argparse.Namespace) -> int:
    """Run the command; one parsed with ``--tf`` is TensorFlow's, reached from here alone (``paratrain.tf.command``)."""
    if args.command == "run":
        run.parse_launch(args)
    if getattr(args, "tf", False):
        from ..tf.command import execute

        return execute(args)
    return COMMANDS[args.command].execute(args)


def _version() -> str:
    from ..version import __version__

    return f"paratrain {__version__}"
