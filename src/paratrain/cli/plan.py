"""``paratrain plan``: memory per GPU, step time and scaling of every strategy, and which one to use.

Examples:
  paratrain plan --model gpt2-medium --gpus 8 --gpu h100 --interconnect nvlink
  paratrain plan --params 7.5B --layers 32 --hidden 4096 --seq-len 4096 --gpus 8 --nodes 4 --inter-node eth-100g
  paratrain plan --model mymodels:build --input 3x224x224 --gpu a100-40gb --gpus 4 --breakdown
  paratrain plan --model model:build_gpt --input long:1024 --gpus 8 --batch 12 --global-batch 480 --base-batch 480
  paratrain plan --model mlp --gpu cpu --gpus 2 --measure
  paratrain plan --model mymodels:recommender --input long:8 --gpu cpu --gpus 3 --ps-servers 1 --optimizer sgd
  paratrain plan --model llama-7b --gpus 8 --nodes 2 --tp 8
  paratrain plan --model llama3-8b --gpus 8 --seq-len 32768 --batch 1 --layout zero3,cp=2
  paratrain plan --model llama3-70b --gpus 8 --nodes 48 --layout dp=8,pp=12,tp=4 --global-batch 2048
  paratrain plan --model gpt3-175b --gpu a100 --gpus 8 --nodes 8 --inter-node ib-hdr-x8 --layout pp=8,tp=8 \
      --batch 1 --global-batch 64 --recompute selective --schedule interleaved-1f1b --virtual-stages 2
  paratrain plan --model-config ./Mistral-7B/config.json --seq-len 4096 --gpus 8

Nothing is allocated or launched: a built-in GPT or --params uses closed forms, any other model is traced on
the meta device, called as training calls it (targets to a forward that takes them, its own loss; --targets).
Memory is in GiB (2**30 bytes), bandwidth in GB/s. See docs/planner.md. The tensor-parallel plan a model gets
is `paratrain tp-plan`; a layout tried for real on a fake process group, `paratrain dry-run`.
"""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return sub.add_parser(
        "plan",
        help="estimate memory and step time per strategy and recommend one",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..flags import add_flags
    from ..planner import PlanConfig
    from .deprecated import add_old_plan_modes

    add_flags(p, PlanConfig)
    add_old_plan_modes(p)


def execute(args: argparse.Namespace) -> int:
    from ..flags import build
    from ..plan_commands.plan import run_plan
    from ..planner import PlanConfig
    from .deprecated import run_old_plan_mode

    old = run_old_plan_mode(args)
    return old if old is not None else run_plan(build(PlanConfig, args))
