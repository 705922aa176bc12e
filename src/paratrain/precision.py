"""Numeric precision of training, one small plugin per mode, apart from strategies.

| name         | parameters | forward                        | backward / step             |
|--------------|------------|--------------------------------|-----------------------------|
| fp32         | fp32       | fp32                           | plain                       |
| bf16-mixed   | fp32       | autocast to bf16, outputs fp32 | plain (bf16 needs no scale) |
| fp16-mixed   | fp32       | autocast to fp16, outputs fp32 | GradScaler (CUDA only)      |
| bf16-true    | bf16       | inputs cast to bf16, outputs fp32 | plain                    |

Sharded strategies (FSDP) also take the choice as a ``MixedPrecisionPolicy`` (bf16/fp16 parameters gathered, fp32
gradient reduction); autocast runs around the model's forward under every strategy, so the ops autocast keeps in
fp32 (softmax, log-softmax, cross-entropy, norms) run in fp32 under FSDP too, as Lightning's and Accelerate's
FSDP mixed precision do.

Outputs: a model called directly hands the loss fp32 outputs, since a loss computed outside autocast on 16-bit
logits loses accuracy. ``Parallel.forward_backward`` owns the loss call, so there the outputs stay in the compute
dtype and the loss runs under autocast, whose fp32 ops (log-softmax, cross-entropy, norms) upcast what they read
as a hand-written autocast loop does, instead of the model's whole output being cast to fp32 first. Whether
that lowers the peak depends on where the step's peak lies: at the CPU sizes measured (benchmarks/RESULTS.md §9)
it did not; the large-vocabulary case on a GPU is not measured yet. Whatever the compute dtype, the loss
``forward_backward`` hands back is float32.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from .batch import ModelCall
from .errors import ConfigError
from .tensor_layouts import grouped, layout_of


class Precision:
    """Full fp32 training: plain backward and step. Subclasses change one hook each."""

    name = "fp32"
    autocast_dtype: torch.dtype | None = None
    input_dtype: torch.dtype | None = None
    """Floating inputs are cast to this dtype before the forward (bf16-true's parameters are bf16)."""

    def validate(self, device: torch.device) -> None:
        """Raise ConfigError when this precision cannot run on ``device``."""

    def convert_module(self, model: nn.Module) -> nn.Module:
        """Change parameter dtypes before wrapping (only bf16-true does)."""
        return model

    def fsdp_policy(self, cast_output: bool = True) -> Any:
        """The FSDP2 ``MixedPrecisionPolicy`` for this precision; ``cast_output=False``: outputs stay in the compute
        dtype (the sharding presets, which cast the root's outputs themselves, and units inside another)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.autocast_dtype is None:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(
            param_dtype=self.autocast_dtype,
            reduce_dtype=torch.float32,
            output_dtype=torch.float32 if cast_output else None,
        )

    def forward_context(self, device: torch.device) -> AbstractContextManager:
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.autocast_dtype)

    def wrap_forward(self, model: nn.Module, device: torch.device) -> None:
        """Run ``model``'s forward under autocast (or on cast inputs) and hand fp32 outputs to the loss, except
        inside ``compute_dtype_outputs``. Autocast runs under every strategy, FSDP's policy included: the policy
        casts parameters, autocast still computes its fp32 ops (softmax, cross-entropy, norms) in fp32, so a loss
        the model computes itself has one value whatever the strategy. Inputs are cast here under every strategy
        too: FSDP's policy casts them only with a ``param_dtype``, which bf16-true (parameters already bf16) has
        not."""
        if self.autocast_dtype is None and self.input_dtype is None:
            return
        inner = model.forward
        cast = functools.partial(_cast_floating, dtype=self.input_dtype)

        @functools.wraps(inner)
        def forward(*args: Any, **kwargs: Any) -> Any:
            if self.input_dtype is not None:
                args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
            with self.forward_context(device):
                out = inner(*args, **kwargs)
            if self._compute_outputs:
                return out
            return tree_map(functools.partial(_cast_floating, dtype=torch.float32), out)

        model.forward = forward  # type: ignore[method-assign]

    _compute_outputs = False

    @contextmanager
    def compute_dtype_outputs(self) -> Iterator[None]:
        """Inside: wrapped forwards return their outputs in the compute dtype, not cast to fp32."""
        self._compute_outputs = True
        try:
            yield
        finally:
            self._compute_outputs = False

    def loss(self, model: nn.Module, call: ModelCall, device: torch.device) -> torch.Tensor:
        """The loss of ``model`` on the micro-batch ``call``, the output left in the compute dtype and a ``loss_fn``
        run under autocast (see the module docstring)."""
        with self.compute_dtype_outputs():
            out = call.forward(model)
        with self.forward_context(device):
            return call.loss(out)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Make gradients true gradients before clipping (only loss scaling changes them)."""

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    skips_overflow = False
    """True where the precision skips steps with non-finite gradients itself (loss scaling lowers its scale)."""

    def skipped(self, optimizer: torch.optim.Optimizer) -> None:
        """The step after ``unscale`` was skipped (the numerics guard): settle what the step would have."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of this plugin (the grad scaler's state, if it has one)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s result."""


def _cast_floating(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
        return x.to(dtype)
    return x


class BF16Mixed(Precision):
    name = "bf16-mixed"
    autocast_dtype = torch.bfloat16


class FP16Mixed(Precision):
    """fp16 autocast with dynamic loss scaling, since fp16 gradients underflow."""

    name = "fp16-mixed"
    autocast_dtype = torch.float16

    def __init__(self) -> None:
        self.scaler: torch.amp.GradScaler | None = None

    def validate(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ConfigError("precision 'fp16-mixed' needs CUDA (loss scaling for fp16 GPUs); use 'bf16-mixed' on CPU")
        self.scaler = ScalerByLayout(device.type)

    def backward(self, loss: torch.Tensor) -> None:
        assert self.scaler is not None
        self.scaler.scale(loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        assert self.scaler is not None
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        assert self.scaler is not None
        self.scaler.step(optimizer)
        self.scaler.update()

    skips_overflow = True

    def skipped(self, optimizer: torch.optim.Optimizer) -> None:
        """The scaler's update ends the step its ``unscale_`` began (the next one would refuse to unscale again)."""
        assert self.scaler is not None
        self.scaler.update()

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])


class ScalerByLayout(torch.amp.GradScaler):
    """torch's ``GradScaler``, unscaling the gradients of one layout a call (:mod:`.tensor_layouts`): its one
    multi-tensor unscale over all of a device's gradients refuses plain tensors beside DTensors, and DTensor's rule
    reduces the found-inf flag over the ranks as the call's first gradient is laid out, so a call holds one layout
    for every rank to agree on whether the step is skipped."""

    def _unscale_grads_(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        grads = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        found: dict[torch.device, torch.Tensor] = {}
        for part in grouped(grads, lambda p: layout_of(p.grad)) or [[]]:  # none: the flag torch gives then
            view = SimpleNamespace(param_groups=[{"params": part}])
            for device, flag in super()._unscale_grads_(view, inv_scale, found_inf, allow_fp16).items():
                found[device] = torch.maximum(found[device], flag) if device in found else flag  # 1.0: found
        return found


class BF16True(Precision):
    """Everything in bf16, parameters and optimizer state included: half the memory, less accuracy."""

    name = "bf16-true"
    input_dtype = torch.bfloat16

    def convert_module(self, model: nn.Module) -> nn.Module:
        return model.to(torch.bfloat16)


_PRECISIONS: dict[str, type[Precision]] = {
    "fp32": Precision,
    "32": Precision,
    "bf16-mixed": BF16Mixed,
    "fp16-mixed": FP16Mixed,
    "16-mixed": FP16Mixed,
    "bf16-true": BF16True,
}


def create_precision(name: str) -> Precision:
    """The precision plugin called ``name``."""
    try:
        return _PRECISIONS[name]()
    except KeyError:
        raise ConfigError(f"unknown precision {name!r}; choose one of: {', '.join(sorted(_PRECISIONS))}") from None
