"""The styles a plan names, as written in ``tp_plan=`` and printed by ``paratrain plan --show-tp-plan``.

Every plan paratrain applies — built in, a model's own, inferred — is written in these names, and every style
built from a name remembers it, so a printed plan is valid ``tp_plan=`` input as printed:

| name | what the module does |
|---|---|
| ``colwise`` | its output features split (a layer feeding a ``rowwise`` one); after the blocks, the output head: split over the vocabulary, its logits left split for the loss |
| ``colwise(input=sequence)`` | the same, gathering an input that holds a slice of the sequence |
| ``fused_colwise(N)`` | a projection computing N blocks side by side (GPT-2's ``[q\\|k\\|v]``): each rank keeps its part of each |
| ``rowwise`` | its input features split, outputs summed over the ranks; an embedding split over the vocabulary |
| ``rowwise(output=sequence)`` | the same, the sum reduce-scattered into slices of the sequence |
| ``sequence_parallel`` | a norm or dropout on this rank's slice of the sequence |
| ``split_sequence`` | its first input cut into slices of the sequence (where the blocks begin) |
| ``gather_sequence`` / ``gather_sequence(KEYWORD)`` | its first input (or keyword input) gathered from slices of the sequence |
| ``replicate`` / ``replicate(output_shard=D)`` | whole on every rank (keeping its slice of the output along D) |
| ``replicate(grad=sum)`` | whole on every rank, seeing this rank's heads only (a per-head norm): its gradient summed over the ranks |
| ``replicate(output_grad=sum)`` | whole on every rank, its output read by this rank's heads only (a latent projection): the output's gradient summed over the ranks |
| ``heads`` | its own parameters indexed by head (attention sinks; a layer fed by a latent) split with the heads |
| ``whole_sequence`` | run whole on every rank over the gathered sequence, its output cut back to this rank's slice (a mixture of experts) |

A ``ParallelStyle`` object of torch's own may stand in any plan as well; it prints as its class name.
"""  # noqa: E501

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    SequenceParallel,
)

from ...errors import ConfigError
from .styles import Colwise, FirstInput, FusedColwise, PerHead, Replicated, Rowwise, VocabHead


def _colwise(input: str | None = None) -> ParallelStyle:
    return Colwise(input_layouts=_sequence(input, "input"))


def _rowwise(output: str | None = None) -> ParallelStyle:
    return Rowwise(output_layouts=_sequence(output, "output"))


def _sequence(value: str | None, what: str) -> Any:
    if value not in (None, "sequence"):
        raise ConfigError(f"{what}={value!r}: the only layout a plan names is 'sequence' (slices of the sequence)")
    return Shard(1) if value else None


def _gather_sequence(keyword: str | None = None) -> ParallelStyle:
    if keyword is None:
        return PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        )
    return PrepareModuleInput(
        input_kwarg_layouts={keyword: Shard(1)},
        desired_input_kwarg_layouts={keyword: Replicate()},
        use_local_output=True,
    )


def _replicate(
    output_shard: str | None = None, grad: str | None = None, output_grad: str | None = None
) -> ParallelStyle:
    for key, value in (("grad", grad), ("output_grad", output_grad)):
        if value not in (None, "sum"):
            raise ConfigError(
                f"replicate({key}={value!r}): the only gradient a plan names is 'sum' (summed over the ranks)"
            )
    return Replicated(
        None if output_shard is None else int(output_shard), summed=grad == "sum", output_summed=output_grad == "sum"
    )


def _whole_sequence() -> ParallelStyle:
    """A module run whole on every rank over the whole sequence (a mixture of experts under sequence parallelism):
    its input gathered from slices, its output cut back to this rank's slice (the backward gathers the gradient,
    so every rank's parameters get the whole one)."""
    return PrepareModuleInputOutput(
        input_layouts=(Shard(1),),
        desired_input_layouts=(Replicate(),),
        use_local_input=True,
        output_layouts=(Replicate(),),
        desired_output_layouts=(Shard(1),),
        use_local_output=True,
    )


def _split_sequence() -> ParallelStyle:
    return FirstInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True)


STYLES: dict[str, Callable[..., ParallelStyle]] = {
    "colwise": _colwise,
    "fused_colwise": lambda parts: FusedColwise(int(parts)),
    "rowwise": _rowwise,
    "sequence_parallel": lambda: SequenceParallel(),
    "split_sequence": _split_sequence,
    "gather_sequence": _gather_sequence,
    "replicate": _replicate,
    "heads": lambda: PerHead(),
    "whole_sequence": _whole_sequence,
}
"""Style names → factories of a fresh style (arguments as written in the name)."""

_SPEC = re.compile(r"^\s*(\w+)\s*(?:\((.*)\))?\s*$")


def style(spec: str) -> ParallelStyle:
    """The style ``spec`` names (``"rowwise(output=sequence)"``), remembering the name."""
    match = _SPEC.match(spec)
    if match is None or match.group(1) not in STYLES:
        raise ConfigError(
            f"{spec!r} is not a style; use one of {', '.join(STYLES)} (docs/tensor-parallel.md lists "
            "what each does) or a torch.distributed.tensor.parallel ParallelStyle"
        )
    args: list[str] = []
    kwargs: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in (match.group(2) or "").split(","))):
        key, eq, value = part.partition("=")
        if eq:
            kwargs[key.strip()] = value.strip().strip("'\"")
        else:
            args.append(part.strip("'\""))
    try:
        made = STYLES[match.group(1)](*args, **kwargs)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"style {spec!r}: {err}") from None
    made.spec = spec.strip()  # type: ignore[attr-defined]
    return made


def head() -> ParallelStyle:
    """The output head's style: ``colwise`` where it stands after the blocks."""
    made = VocabHead()
    made.spec = "colwise"  # type: ignore[attr-defined]
    return made


def spec_of(made: ParallelStyle | str) -> str:
    """How ``made`` is written in a plan."""
    return made if isinstance(made, str) else getattr(made, "spec", type(made).__name__)
