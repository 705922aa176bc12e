"""``paratrain plan``: the model its config names, planned, printed as a table or JSON."""

from __future__ import annotations

import json

from ..planner import PlanConfig, format_plan, make_plan, plan_to_json
from ..workloads.model_names import resolve_model


def run_plan(config: PlanConfig) -> int:
    """Plan the model ``config.model_spec`` names and print the plan; the exit code."""
    plan = make_plan(resolve_model(config.model_spec), config)
    print(json.dumps(plan_to_json(plan), indent=2) if config.json else format_plan(plan, breakdown=config.breakdown))
    return 0
