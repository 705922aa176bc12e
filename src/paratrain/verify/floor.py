"""How far apart two correct runs may be: the noise floor verify measures, or the user's fixed tolerance.

A parallel run adds its sums in another order than one process (each rank reduces its own shard, then the ranks
average), so its floats differ from the reference's in the last bits, and an optimizer may amplify that: Adam and
Adadelta divide by the square root of small second moments, and a 1e-7 difference is 1e-5 a few steps later. A
fixed tolerance then fails correct code. So verify trains the reference twice, the second time with every global
batch in another order (:data:`~paratrain.verify.reference.ORDERS`): the same math, other roundings. How far those
two correct runs drift apart, per step and per entry of the state dict, is the floor; the parallel run passes
where its distance from the reference stays within ``MARGIN`` times the floor plus a few float32 ulps of the value
(so an exact-zero floor does not fail one rounding). A bug moves the numbers by orders of magnitude more.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .record import Record

MARGIN = 10.0
"""How many times the floor a parallel run may differ from the reference."""
ULPS = 8 * torch.finfo(torch.float32).eps
"""The absolute allowance, relative to values above 1: 8 float32 ulps (about 1e-6)."""
REPEATABLE = 1e-4
"""Before the first update both reference runs hold the same weights and the same samples: their first losses may
differ by rounding only, far less than this (relative). More means the step draws random numbers or depends on
the order of the samples, and the floor measures that, not rounding."""


@dataclass(frozen=True, kw_only=True)
class Bound:
    """The largest difference counted as equal for one number or entry at one step."""

    allowed: float
    floor: float | None = None
    """The measured floor it came from; None under a fixed tolerance."""


@dataclass(kw_only=True)
class FloorSummary:
    """The measured floor, for the report: the largest over the steps compared."""

    margin: float
    loss: float
    grad_norm: float
    parameters: float
    """The largest max-|difference| of any state entry between the two reference runs."""
    parameters_by_step: list[float] = field(default_factory=list)
    """Per step: the largest max-|difference| of any entry (running maximum)."""


class Judge(Protocol):
    """What first_divergence asks: how much may this number differ at this step."""

    def scalar(self, what: str, step: int, reference: float) -> Bound: ...

    def entry(self, step: int, key: str, scale: float) -> Bound: ...


@dataclass(frozen=True)
class Tolerance:
    """The user's fixed tolerance (``--tolerance``): relative to values above 1, the same at every step."""

    tolerance: float

    def scalar(self, what: str, step: int, reference: float) -> Bound:
        return Bound(allowed=self.tolerance * max(1.0, abs(reference)))

    def entry(self, step: int, key: str, scale: float) -> Bound:
        return Bound(allowed=self.tolerance * max(1.0, scale))


def _running_max(values: list[float]) -> list[float]:
    out, top = [], 0.0
    for v in values:
        top = max(top, v)
        out.append(top)
    return out


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


class NoiseFloor:
    """The floor between the reference and its twin in another summation order, per step as a running maximum
    (noise grows as training goes on; a step where it happened to cancel proves nothing)."""

    def __init__(self, ref: Record, twin: Record, margin: float = MARGIN) -> None:
        steps = min(ref.steps, twin.steps)
        self.margin = margin
        self.losses = _running_max([abs(_mean(ref.losses[s]) - _mean(twin.losses[s])) for s in range(steps)])
        self.grad_norms = _running_max([abs(ref.grad_norms[s] - twin.grad_norms[s]) for s in range(steps)])
        self.entries: list[dict[str, float]] = []
        top: dict[str, float] = {}
        for s in range(steps):
            a, b = ref.states[s], twin.states[s]
            for key in a.keys() & b.keys():
                diff = float((a[key].double() - b[key].double()).abs().max()) if a[key].numel() else 0.0
                top[key] = max(top.get(key, 0.0), diff)
            self.entries.append(dict(top))

    def _at(self, values: list, step: int):
        return values[min(step, len(values) - 1)] if values else None

    def scalar(self, what: str, step: int, reference: float) -> Bound:
        floor = self._at(self.losses if what == "loss" else self.grad_norms, step) or 0.0
        return Bound(allowed=self.margin * floor + ULPS * max(1.0, abs(reference)), floor=floor)

    def entry(self, step: int, key: str, scale: float) -> Bound:
        floor = (self._at(self.entries, step) or {}).get(key, 0.0)
        return Bound(allowed=self.margin * floor + ULPS * max(1.0, scale), floor=floor)

    def unrepeatable(self, ref: Record) -> str | None:
        """Why the floor is not rounding (the first losses apart beyond :data:`REPEATABLE`), or None."""
        if not self.losses or not ref.losses[0]:
            return None
        first = _mean(ref.losses[0])
        if self.losses[0] <= REPEATABLE * max(1.0, abs(first)):
            return None
        return (
            f"two one-process runs on the same samples, from the same weights, computed first losses "
            f"{self.losses[0]:.3g} apart ({first:.6g}): far more than rounding (under {REPEATABLE:g} relative)"
        )

    def summary(self) -> FloorSummary:
        by_step = [max(e.values(), default=0.0) for e in self.entries]
        return FloorSummary(
            margin=self.margin,
            loss=max(self.losses, default=0.0),
            grad_norm=max(self.grad_norms, default=0.0),
            parameters=max(by_step, default=0.0),
            parameters_by_step=by_step,
        )
