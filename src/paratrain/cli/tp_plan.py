"""``paratrain tp-plan``: the tensor-parallel plan ``prepare`` would apply to a model at degree N, printed as the
``tp_plan`` dict to paste into ``Parallel(..., tp_plan=tp_plan)``, without a run.

Examples:
  paratrain tp-plan --model mymodels:build_gpt --tp 2
  paratrain tp-plan --model-config ./Llama-3-8B/config.json --tp 8 --auto

The model's own or built-in plan, else one inferred from its blocks (--auto: the inferred one even where a plan is
built in), with the inferred plan's reasons as comments. See docs/tensor-parallel.md.
"""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return sub.add_parser(
        "tp-plan",
        help="print the tensor-parallel plan a model gets at degree N",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..flags import add_flags
    from ..plan_commands.tp_plan import TpPlanConfig

    add_flags(p, TpPlanConfig)


def execute(args: argparse.Namespace) -> int:
    from ..flags import build
    from ..plan_commands.tp_plan import TpPlanConfig, run_tp_plan

    return run_tp_plan(build(TpPlanConfig, args))
