"""``paratrain export CKPT OUT.pt``: a checkpoint's model as one plain state_dict file."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return sub.add_parser(
        "export",
        help="write a checkpoint's model as one plain state_dict file",
        description="Consolidate a (sharded) checkpoint's model into one file of full tensors with "
        "the plain model's parameter names, loadable with "
        "torch.load(OUT, weights_only=True) and model.load_state_dict.",
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a checkpoint folder (step-…) or a checkpoint directory (its latest one)")
    p.add_argument("out", help="the .pt file to write")
    p.add_argument("--model", type=int, default=0, help="which prepared model, when the job had several (default 0)")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")


def execute(args: argparse.Namespace) -> int:
    from ..checkpoint.export import export

    info = export(args.checkpoint, args.out, model=args.model, force=args.force)
    print(
        f"wrote {info['path']}: {info['tensors']} tensors, {info['parameters']:,} values, "
        f"{info['bytes'] / 2**20:.1f} MiB (step {info['step']})"
    )
    return 0
