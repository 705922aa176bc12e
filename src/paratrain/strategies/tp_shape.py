"""The planner's view of a built model's tensor-parallel plan, for ``strategy="auto"``.

The planner sizes tensor parallelism from a :class:`~paratrain.planner.model_stats.TPShape`; which parameters a real
model's plan splits only the runtime's plans know (``distributed.tensor_parallel.plans``). This module, above
both, reads one into the other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from ..errors import ConfigError
from ..model.structure import forward_pieces
from ..planner.model_stats import TPShape

if TYPE_CHECKING:
    from ..distributed.tensor_parallel.plans import TPPlan


def model_shape(model: nn.Module) -> TPShape | None:
    """The TP shape of a model with a built-in plan (transformers' GPT-2 and Llama, paratrain's GPT), read from its
    config and its plan: per wrap unit, the parameters the plan's column- and row-wise styles split (a row-wise
    linear's bias stays whole). None for any other model: ``auto`` cannot know how a user's plan would split it.
    Imports tensor parallelism (a second): call it only when a TP layout is worth weighing."""
    from ..distributed.tensor_parallel.plans import plan_for

    try:
        plan = plan_for(model, None)
    except ConfigError:
        return None
    per_unit = split_per_unit(model, plan, [unit for unit, _ in forward_pieces(model)])
    cfg = getattr(model, "config", None)
    if cfg is not None:  # transformers
        layers, hidden, seq_len = cfg.num_hidden_layers, cfg.hidden_size, cfg.max_position_embeddings
    else:
        layers, hidden, seq_len = model.cfg.layers, model.cfg.hidden, model.cfg.seq_len
    return TPShape(
        layers=layers,
        hidden=hidden,
        seq_len=seq_len,
        split=per_unit,
        divides=tuple(plan.divisible(model).items()),
        sequence_parallel=plan.sequence_parallel,
    )


def split_per_unit(model: nn.Module, plan: TPPlan, units: list[str]) -> tuple[int, ...]:
    """Trainable parameters ``plan`` splits over the tensor-parallel ranks in each of ``units`` (module names; a name
    that is no module, ``(root)``, holds none): those of its column- and row-wise layers (a row-wise layer's bias
    stays whole) and of the modules split with the heads. A weight shared by two units (a tied head) is counted
    once, in the first."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from ..distributed.tensor_parallel.styles import PerHead

    split: set[int] = set()
    for name, style in plan.per_module(model):
        if isinstance(style, (ColwiseParallel, RowwiseParallel, PerHead)):
            whole = "bias" if isinstance(style, RowwiseParallel) else None
            split.update(id(p) for n, p in model.get_submodule(name).named_parameters() if n != whole)
    modules = dict(model.named_modules())
    counted: set[int] = set()
    out = []
    for unit in units:
        held = {id(p): p for p in modules[unit].parameters()} if unit and unit in modules else {}
        mine = [p for i, p in held.items() if i in split and i not in counted and p.requires_grad]
        counted.update(held)
        out.append(sum(p.numel() for p in mine))
    return tuple(out)
