"""How far apart two correct runs may be: the noise floor verify measures, or the user's fixed tolerance.

A parallel run adds its sums in another order than one process (each rank reduces its own shard, then the ranks
average), so its floats differ from the reference's in the last bits, and an optimizer may amplify that: Adam and
Adadelta divide by the square root of small second moments, and a 1e-7 difference is 1e-5 a few steps later. A
fixed tolerance then fails correct code. So verify trains the reference twice, the second time with every global
batch in another order (:data:`~paratrain.verify.reference.ORDERS`): the same math, other roundings. How far those
two correct runs drift apart, per step and per entry of the state dict, is the floor; the parallel run passes
where its distance from the reference stays within ``MARGIN`` times the floor plus a few float32 ulps of the value
(so an exact-zero floor does not fail one rounding). A bug moves the numbers by orders of magnitude more.

Under a 16-bit compute dtype (bf16-mixed, fp16-mixed, bf16-true) reordering is not where the rounding is: each
rank's matmuls round their micro-batch's gradient to the compute dtype (relative 4e-3 in bf16) before the ranks and
micro-steps add them in fp32, where one process rounds the global batch's gradient once. A twin that only reorders
rounds exactly like the reference (a floor of 0 at the first step), so correct code failed by 1e-4. The twin then
also runs every training forward on the parallel run's micro-batches, its parameters cast to the compute dtype
(:func:`split_forward`, as FSDP's mixed precision casts them: embeddings and norms too, where autocast casts only
matmuls): the same math (samples are independent: a model with BatchNorm is not split), rounded where any strategy
rounds. The user's loop and loss stay as they are, so no planted bug moves into the floor (a bare backward, a
summed loss, the data read: the twin's loop computes what the reference's does). Where each rounding is 4e-3, which
entries an optimizer amplifies is chance (Adam moves an entry whose gradient is rounding noise by up to lr, in one
run and not in the other): the twin shows how far that goes, not where, so each entry's floor is the largest of the
state's at that step.

Roundings no one-process twin reproduces at their source are allowed by the compute dtype instead
(:func:`compute_rounding`): tensor parallelism splits matmuls along the hidden dimension and rounds each rank's
partial sums to the compute dtype before adding them (GPT-2, tp=2, bf16: losses 5e-6 apart, relative, at the first
step; the twin's floor held that by its size, a wider split need not be); FSDP runs norms in the compute dtype
where the twin's autocast runs them in fp32; bf16-true hands back a bf16 loss, one ulp (4e-3) off for another batch
split, which no twin on the reference's batches shows. So the loss and gradient norm may differ by a fraction of an
ulp of the compute dtype (two ulps of a 16-bit loss), and each entry by a few ulps of the largest update the
reference made to it so far: far below every scale a bug moves the numbers by (a missing division: 2x at least).
"""

from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_flatten, tree_unflatten

from .record import Record, training_call

MARGIN = 10.0
"""How many times the floor a parallel run may differ from the reference."""
ULPS = 8 * torch.finfo(torch.float32).eps
"""The absolute allowance, relative to values above 1: 8 float32 ulps (about 1e-6)."""
COMPUTE_ULPS = 1 / 32
"""The loss and gradient norm under a 16-bit compute dtype may differ by this many of its ulps, relative, beyond
the floor (2.4e-4 in bf16, 50x the tensor-parallel rounding measured on GPT-2)."""
OWN_LOSS_ULPS = 2.0
"""With 16-bit parameters (bf16-true) the loss itself is 16-bit: two of its ulps."""
UPDATE_ULPS = 4.0
"""Each entry may differ by this many ulps of the compute dtype of the largest update the reference made to it so
far (3% in bf16): a 16-bit gradient summed over a batch is off by a few ulps (GPT-2's final LayerNorm weight under
zero3: one ulp and a fifth)."""
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


def _largest_updates(states: list[dict[str, torch.Tensor]]) -> list[dict[str, float]]:
    """Per step after the first state: each floating entry's largest max-|change| of a step so far."""
    out: list[dict[str, float]] = []
    top: dict[str, float] = {}
    for before, after in zip(states, states[1:]):
        for key in before.keys() & after.keys():
            if after[key].is_floating_point() and after[key].numel():
                change = float((after[key].double() - before[key].double()).abs().max())
                top[key] = max(top.get(key, 0.0), change)
        out.append(dict(top))
    return out


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


@dataclass(frozen=True)
class Rounding:
    """What a precision rounds that the measured floor cannot hold (0 in fp32), relative."""

    scalars: float = 0.0
    """Of the loss and the gradient norm."""
    updates: float = 0.0
    """Of each entry's largest update so far."""


def _compute_dtype(precision: Any) -> torch.dtype | None:
    """The 16-bit dtype ``precision`` (a :class:`~paratrain.precision.Precision`) computes in; None in fp32."""
    return precision.input_dtype or precision.autocast_dtype


def compute_rounding(precision: Any) -> Rounding:
    """The rounding of the parallel run under ``precision`` that the measured floor does not hold; see the module
    docstring."""
    dtype = _compute_dtype(precision)
    if dtype is None:
        return Rounding()
    eps = torch.finfo(dtype).eps
    return Rounding(scalars=(OWN_LOSS_ULPS if precision.input_dtype else COMPUTE_ULPS) * eps, updates=UPDATE_ULPS * eps)


class NoiseFloor:
    """The floor between the reference and its twin in another summation order, per step as a running maximum
    (noise grows as training goes on; a step where it happened to cancel proves nothing); ``rounding``: the
    compute dtype's allowance (:func:`compute_rounding`), on the updates the reference made from ``start``."""

    def __init__(
        self,
        ref: Record,
        twin: Record,
        margin: float = MARGIN,
        rounding: Rounding = Rounding(),
        start: dict[str, torch.Tensor] | None = None,
    ) -> None:
        steps = min(ref.steps, twin.steps)
        self.margin, self.rounding = margin, rounding
        self.updates = _largest_updates([start or {}, *ref.states[:steps]]) if rounding.updates else []
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
        allowed = self.margin * floor + ULPS * max(1.0, abs(reference)) + self.rounding.scalars * abs(reference)
        return Bound(allowed=allowed, floor=floor)

    def entry(self, step: int, key: str, scale: float) -> Bound:
        entries = self._at(self.entries, step) or {}
        floor = max(entries.values(), default=0.0) if self.rounding.updates else entries.get(key, 0.0)
        update = (self._at(self.updates, step) or {}).get(key, 0.0)
        return Bound(allowed=self.margin * floor + ULPS * max(1.0, scale) + self.rounding.updates * update, floor=floor)

    def unrepeatable(self, ref: Record) -> str | None:
        """Why the floor is not rounding (the first losses apart beyond :data:`REPEATABLE`), or None."""
        if not self.losses or not ref.losses[0]:
            return None
        first = _mean(ref.losses[0])
        repeatable = max(REPEATABLE, self.rounding.scalars)  # a 16-bit loss rounds by more
        if self.losses[0] <= repeatable * max(1.0, abs(first)):
            return None
        return (
            f"two one-process runs on the same samples, from the same weights, computed first losses "
            f"{self.losses[0]:.3g} apart ({first:.6g}): far more than rounding (under {repeatable:g} relative)"
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


def rounding_dtype(model: nn.Module, precision: Any) -> torch.dtype | None:
    """The 16-bit compute dtype of ``precision`` (the run's :class:`~paratrain.precision.Precision`) when splitting
    the global batch into the parallel run's micro-batches is the same math for ``model`` (no BatchNorm, whose
    training statistics are the batch's); None: the twin only reorders."""
    dtype = _compute_dtype(precision)
    batchnorm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    return None if batchnorm else dtype


def split_like_ranks(model: nn.Module, size: int | None, precision: Any) -> None:
    """The noise floor's twin: under a 16-bit compute dtype (:func:`rounding_dtype`), run the prepared ``model``'s
    training forwards on the parallel run's micro-batches of ``size`` (:func:`split_forward`); else, or without a
    ``size`` (the reference itself), leave it as it is."""
    dtype = rounding_dtype(model, precision)
    if size and dtype is not None:
        split_forward(model, size, dtype)


def split_forward(model: nn.Module, size: int, dtype: torch.dtype) -> None:
    """Run each training forward of the prepared ``model`` on micro-batches of ``size`` samples, one call each, its
    parameters cast to ``dtype`` (as FSDP's mixed precision casts them; autocast casts only a matmul's), so each
    rounds every gradient to the compute dtype as a rank does. The outputs are joined: batch tensors along dim 0, a
    scalar (a loss the model computes) as the mean weighted by the micro-batches' sizes. The cast parameters go in
    with the reparametrisation torch's ``functional_call`` uses, around the inner forward, so the model's hooks (the
    replay's, the recorder's) run once per call, not once per micro-batch."""
    inner = model.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        leaves, spec = tree_flatten((args, kwargs))
        n = next((t.shape[0] for t in leaves if isinstance(t, torch.Tensor) and t.dim()), 0)
        if n <= size or not training_call(model):
            return inner(*args, **kwargs)
        outs = []
        for start in range(0, n, size):
            part = [t[start : start + size] if _batched(t, n) else t for t in leaves]
            call_args, call_kwargs = tree_unflatten(part, spec)
            cast = {name: p.to(dtype) if p.is_floating_point() else p for name, p in model.named_parameters()}
            with _reparametrize_module(model, cast, tie_weights=True):
                outs.append(inner(*call_args, **call_kwargs))
        return _join_outputs(outs, [min(size, n - start) for start in range(0, n, size)])

    model.forward = forward  # type: ignore[method-assign]


def _batched(x: Any, n: int) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == n


def _join_outputs(outs: list[Any], sizes: list[int]) -> Any:
    flat = [tree_flatten(out) for out in outs]
    leaves = []
    for parts in zip(*(leaves for leaves, _ in flat)):
        first = parts[0]
        if isinstance(first, torch.Tensor) and first.dim() and first.shape[0] == sizes[0]:
            leaves.append(torch.cat(parts))
        elif isinstance(first, torch.Tensor) and first.is_floating_point():
            leaves.append(sum(p * k for p, k in zip(parts, sizes)) / sum(sizes))
        else:
            leaves.append(first)
    return tree_unflatten(leaves, flat[0][1])
