"""``paratrain slurm``: write an sbatch script that runs a script on several nodes through ``paratrain run``."""

from __future__ import annotations

import argparse
import shlex

from ..launcher.sbatch import DEFAULT_GRACE_S


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return sub.add_parser(
        "slurm",
        help="write an sbatch script for a multi-node job",
        description="Write a ready sbatch script: one `paratrain run` per node via srun, which "
        "reads the allocation itself. Prints it, or writes it with --output.",
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", "-N", type=int, default=1, help="nodes to allocate (default 1)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node; also the processes per node by default")
    p.add_argument("--nproc-per-node", "-n", type=int, help="processes per node (default: the GPUs per node)")
    p.add_argument("--cpus-per-task", "-c", type=int, help="CPU cores per node for its processes together")
    p.add_argument("--time", "-t", help="time limit (MINUTES, HH:MM:SS, D-HH)")
    p.add_argument("--partition", "-p", help="SLURM partition")
    p.add_argument("--account", "-A", help="account to charge")
    p.add_argument("--job-name", "-J", help="job name (default: the script's name)")
    p.add_argument("--log", default="%x-%j.out", help="sbatch --output: the job's log (default %%x-%%j.out)")
    p.add_argument(
        "--grace",
        type=int,
        metavar="SECONDS",
        help="SIGUSR1 this long before the time limit: the ranks save, the job requeues itself and resumes "
        f"(default {DEFAULT_GRACE_S}; 0: off, the default with --tf, whose workers do not save on a signal)",
    )
    p.add_argument(
        "--setup",
        action="append",
        default=[],
        metavar="LINE",
        help="a shell line to run before srun, e.g. 'source .venv/bin/activate' (repeatable)",
    )
    p.add_argument(
        "--run-args",
        default="",
        metavar="FLAGS",
        help="more `paratrain run` flags as one string: --run-args='--rdzv-timeout 900'",
    )
    p.add_argument(
        "--tf", dest="tf_script", action="store_true", help="a TensorFlow script: `paratrain run --tf` on every node"
    )
    p.add_argument("-m", "--module", action="store_true", help="the target is a module (python -m)")
    p.add_argument("--output", metavar="FILE", help="write the script to FILE instead of printing it")
    p.add_argument("target", help="training script (or module with -m)")
    p.add_argument("target_args", nargs=argparse.REMAINDER, help="arguments for the script")


def execute(args: argparse.Namespace) -> int:
    from ..launcher.sbatch import SbatchSpec, write_sbatch

    spec = SbatchSpec(
        target=args.target,
        target_args=tuple(args.target_args),
        module=args.module,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        nproc_per_node=args.nproc_per_node,
        cpus_per_task=args.cpus_per_task,
        time=args.time,
        partition=args.partition,
        account=args.account,
        job_name=args.job_name,
        log=args.log,
        setup=tuple(args.setup),
        grace=args.grace if args.grace is not None else 0 if args.tf_script else DEFAULT_GRACE_S,
        run_args=(*(("--tf",) if args.tf_script else ()), *shlex.split(args.run_args)),
    )
    write_sbatch(spec, args.output)
    return 0
