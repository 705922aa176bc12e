"""Old spellings that still work, each with one line naming the new one: ``plan --dry-run`` (now ``paratrain
dry-run``) and ``plan --show-tp-plan [auto]`` (now ``paratrain tp-plan [--auto]``). Their flags are hidden from
``plan --help``; ``--world`` and ``--strategy`` were ``--dry-run``'s alone."""

from __future__ import annotations

import argparse
import sys


def add_old_plan_modes(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, help=argparse.SUPPRESS)
    p.add_argument("--strategy", help=argparse.SUPPRESS)
    p.add_argument("--show-tp-plan", nargs="?", const="model", choices=["model", "auto"], help=argparse.SUPPRESS)


def run_old_plan_mode(args: argparse.Namespace) -> int | None:
    """The old mode ``plan`` was given, run as its own command now (its exit code), or None: a plan."""
    if args.dry_run:
        return _dry_run(args)
    if args.show_tp_plan:
        return _tp_plan(args)
    for flag, value in (("--world", args.world), ("--strategy", args.strategy)):
        if value is not None:
            from ..errors import ConfigError

            raise ConfigError(
                f"{flag} is `paratrain dry-run`'s flag (plan compares every layout); run "
                f"`paratrain dry-run {flag} {value} ...`"
            )
    return None


def _dry_run(args: argparse.Namespace) -> int:
    from ..dry_run.command import DryRunConfig, run_dry_run

    _note("`paratrain plan --dry-run` is now `paratrain dry-run` (--world N --per-node G for --gpus/--nodes)")
    per_node = args.gpus if args.world is None or args.gpus > 1 else 8
    config = DryRunConfig(
        model=args.model,
        model_config=args.model_config,
        world=args.gpus * args.nodes if args.world is None else args.world,
        per_node=per_node,
        strategy=args.strategy or "zero3",
        tp=args.tp,
        dp=args.dp,
        precision="fp32" if args.precision == "auto" else args.precision,
        optimizer=args.optimizer,
        json=args.json,
    )
    return run_dry_run(config)


def _tp_plan(args: argparse.Namespace) -> int:
    from ..flags import build
    from ..plan_commands.tp_plan import TpPlanConfig, run_tp_plan
    from ..planner import ModelSpec

    _note(
        f"`paratrain plan --show-tp-plan{' auto' if args.show_tp_plan == 'auto' else ''}` is now `paratrain "
        f"tp-plan{' --auto' if args.show_tp_plan == 'auto' else ''}`"
    )
    return run_tp_plan(TpPlanConfig(model_spec=build(ModelSpec, args), tp=args.tp, auto=args.show_tp_plan == "auto"))


def _note(message: str) -> None:
    print(f"paratrain: deprecated: {message}", file=sys.stderr, flush=True)
