"""``paratrain k8s``: write a Kubeflow Trainer TrainJob that runs a script on several nodes through ``paratrain run``.

Examples:
  paratrain k8s --image registry.example/team/train:1 --nodes 4 --gpus-per-node 8 --output job.yaml train.py
  paratrain k8s --image IMAGE --nodes 2 --nproc-per-node 4 --cpus-per-node 16 --env HF_HOME=/cache train.py --lr 3e-4

Each node's container runs `paratrain run`, which reads the PET_* variables the Trainer sets. Submit with
`kubectl apply -f job.yaml`. See docs/kubernetes.md.
"""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return sub.add_parser(
        "k8s",
        help="write a Kubeflow Trainer TrainJob manifest for a multi-node job",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..flags import add_flags
    from ..launcher.trainjob import TrainJobSpec

    add_flags(p, TrainJobSpec)
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a variable for every node's container (repeatable)",
    )
    p.add_argument(
        "--output", metavar="FILE", help="write the manifest to FILE (JSON if it ends in .json) instead of printing it"
    )
    p.add_argument("target", help="training script (or module with -m), as a path inside the image")
    p.add_argument("target_args", nargs=argparse.REMAINDER, help="arguments for the script")


def execute(args: argparse.Namespace) -> int:
    from ..flags import build
    from ..launcher.trainjob import TrainJobSpec, write_trainjob

    spec = build(TrainJobSpec, args, target=args.target, target_args=tuple(args.target_args), env=tuple(args.env))
    write_trainjob(spec, args.output)
    return 0
