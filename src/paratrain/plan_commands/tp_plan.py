"""``paratrain tp-plan``: the tensor-parallel plan ``prepare`` would apply to a model, without a run.

The same choice as at run time (:func:`paratrain.distributed.tensor_parallel.infer.choose_plan`): the model's own or
built-in plan, else one inferred from its blocks (``tp_plan="auto"``, each split checked on this process first).
It is printed as Python, ready to paste and edit as ``Parallel(..., tp_plan=tp_plan)``; an inferred plan's
summary (why each split, what stays whole) and its warning (what it leaves whole of the blocks, as ``prepare``
warns it) in comments above it. No ``--input`` is needed: the plan reads none (the probe runs the model on token ids
of its own).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..errors import ConfigError
from ..flags import flag
from ..planner import ModelSpec
from ..planner.model_stats import RunnableModel
from ..workloads.model_names import resolve_model


@dataclass(frozen=True, kw_only=True)
class TpPlanConfig:
    """What ``paratrain tp-plan`` prints: the plan of one model at one tensor-parallel degree."""

    model_spec: ModelSpec = field(default_factory=ModelSpec, metadata=flag(title="model"))
    """The model, built here on the meta device."""
    tp: int | None = None
    """The tensor-parallel degree (N >= 2): the plan depends on it."""
    auto: bool = False
    """Print the plan inferred from the model's blocks, as tp_plan='auto' gives it, even where one is built in."""

    def __post_init__(self) -> None:
        if self.tp is None or self.tp < 2:
            raise ConfigError(
                f"tp-plan needs --tp N (N >= 2): the plan depends on the degree"
                f"{'' if self.tp is None else f'; got --tp {self.tp}'}"
            )


_NO_INPUT = "long:8"
"""The sample a ``module:factory`` model is resolved with where ``--input`` is not given: the plan never reads it."""


def run_tp_plan(config: TpPlanConfig) -> int:
    """Print the plan ``config`` asks for; the exit code."""
    spec = config.model_spec
    model = resolve_model(spec if spec.input_spec else replace(spec, input_spec=_NO_INPUT))
    print("\n".join(tp_plan_lines(model, config.tp, infer=config.auto)))
    return 0


def tp_plan_lines(model: object, degree: int, infer: bool) -> list[str]:
    """What ``Parallel(..., tp=degree)`` would split in ``model`` and how, as a ``tp_plan`` dict in Python;
    ``infer``: as with ``tp_plan="auto"`` (else the built-in plan wins when there is one)."""
    from ..distributed.tensor_parallel.infer import choose_plan

    if not isinstance(model, RunnableModel):
        raise ConfigError(
            "tp-plan builds the model: give --model NAME or module:factory, or --model-config, not --params"
        )
    built = model.factory()
    plan = choose_plan(built, "auto" if infer else None, degree)
    head = (
        f"# {plan.summary[0].removeprefix('paratrain: ')}"
        if plan.summary
        else f"# tp plan {plan.name!r} over tp={degree}" + (" (sequence parallel)" if plan.sequence_parallel else "")
    )
    warned = [f"# warning: {plan.warning}"] if plan.warning else []
    notes = [f"#   {line.strip()}" for line in plan.summary[1:]]
    entries = [f"    {pattern!r}: {spec!r}," for pattern, spec in plan.printed().items()]
    return [head, *warned, *notes, "tp_plan = {", *entries, "}"]
