"""``paratrain plan --show-tp-plan``: the tensor-parallel plan ``prepare`` would apply to a model, without a run.

The same choice as at run time (:func:`paratrain.distributed.tensor_parallel.infer.choose_plan`): the model's own or
built-in plan, else one inferred from its blocks (``tp_plan="auto"``, each split checked on this process first).
It is printed as Python, ready to paste and edit as ``Parallel(..., tp_plan=tp_plan)``; an inferred plan's
summary (why each split, what stays whole) in comments above it.
"""
from __future__ import annotations

from ..errors import ConfigError
from ..planner.model_stats import RunnableModel


def tp_plan_lines(model: object, degree: int | None, infer: bool) -> list[str]:
    """What ``Parallel(..., tp=degree)`` would split in ``model`` and how, as a ``tp_plan`` dict in Python;
    ``infer``: as with ``tp_plan="auto"`` (else the built-in plan wins when there is one)."""
    from ..distributed.tensor_parallel.infer import choose_plan

    if degree is None or degree < 2:
        raise ConfigError("--show-tp-plan needs --tp N (N >= 2): the plan depends on the degree")
    if not isinstance(model, RunnableModel):
        raise ConfigError("--show-tp-plan builds the model: give --model NAME or module:factory, or --model-config, "
                          "not --params")
    built = model.factory()
    plan = choose_plan(built, "auto" if infer else None, degree)
    head = (f"# {plan.summary[0].removeprefix('paratrain: ')}" if plan.summary else
            f"# tp plan {plan.name!r} over tp={degree}" + (" (sequence parallel)" if plan.sequence_parallel else ""))
    notes = [f"#   {line.strip()}" for line in plan.summary[1:]]
    entries = [f"    {pattern!r}: {spec!r}," for pattern, spec in plan.printed().items()]
    return [head, *notes, "tp_plan = {", *entries, "}"]
