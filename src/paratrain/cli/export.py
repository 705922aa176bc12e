"""``paratrain export CKPT OUT.pt``: a checkpoint's model as one plain state_dict file;
``paratrain export --format hf CKPT OUT/``: as a Hugging Face folder (safetensors shards, their index, config.json)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return sub.add_parser(
        "export",
        help="write a checkpoint's model as one plain state_dict file or a Hugging Face folder",
        description="Consolidate a (sharded) checkpoint's model into one file of full tensors with "
        "the plain model's parameter names, loadable with "
        "torch.load(OUT, weights_only=True) and model.load_state_dict; with --format hf, into a new folder of "
        "safetensors shards, model.safetensors.index.json and config.json, loadable with from_pretrained(OUT).",
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a checkpoint folder (step-…) or a checkpoint directory (its latest one)")
    p.add_argument("out", help="the .pt file to write (--format hf: the new folder)")
    p.add_argument("--model", type=int, default=0, help="which prepared model, when the job had several (default 0)")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists (--format pt)")
    p.add_argument(
        "--format", choices=("pt", "hf"), default="pt", help="pt: one torch.save file; hf: a Hugging Face folder"
    )
    p.add_argument(
        "--config",
        metavar="DIR",
        help="--format hf: a folder with the model's config.json (default: the one a transformers model's "
        "checkpoint holds)",
    )
    p.add_argument(
        "--max-shard-size", type=float, default=5.0, metavar="GIB", help="--format hf: the largest shard (default 5)"
    )


def execute(args: argparse.Namespace) -> int:
    from ..checkpoint.export import export

    info = export(
        args.checkpoint,
        args.out,
        model=args.model,
        force=args.force,
        format=args.format,
        config=args.config,
        shard_bytes=int(args.max_shard_size * 2**30),
    )
    print(
        f"wrote {info['path']}: {info['tensors']} tensors, {info['parameters']:,} values, "
        f"{info['bytes'] / 2**20:.1f} MiB (step {info['step']})"
    )
    return 0
