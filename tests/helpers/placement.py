"""Where a rank's tensors live, checked while a case of the GPU suite runs (tests/helpers/gpu_job.py).

On a node each rank must compute, keep its state and communicate on its own GPU, ``cuda:LOCAL_RANK``; a rank whose
tensors land on GPU 0 still trains correctly at world 1, and on several GPUs crowds GPU 0 or fails. So the probe
looks at every prepared model (its parameters and buffers), at every optimizer step (each parameter, its gradient
and the optimizer's state: the multi-tensor and fused paths CUDA takes by default) and after ``load_weights``, and
notes the current CUDA device at each step. It hooks torch's global optimizer-step hook and wraps two methods of
``Parallel`` in the job's process only, so every worker runs unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook

import paratrain

KEPT = 8
"""Misplacements noted per case (the first ones say what is wrong)."""


class Placement:
    """The probe of one case. ``home``: where parameters, gradients and optimizer state belong, ``"device"`` (this
    rank's accelerator device) or ``"cpu"`` (offloaded; buffers stay on the device)."""

    def __init__(self, accelerator: str, home: str = "device") -> None:
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = torch.device("cuda", self.local_rank) if accelerator == "cuda" else torch.device("cpu")
        self.home = self.device if home == "device" else torch.device("cpu")
        self.misplaced: list[str] = []
        self.steps = 0

    @contextmanager
    def watching(self) -> Iterator[None]:
        """Within, every prepared model, optimizer step and ``load_weights`` is checked."""
        prepare, load_weights = paratrain.Parallel.prepare_model, paratrain.Parallel.load_weights

        def prepared(par: paratrain.Parallel, model: nn.Module, **kwargs: object) -> nn.Module:
            out = prepare(par, model, **kwargs)
            self.check_module(out, "after prepare")
            return out

        def loaded(par: paratrain.Parallel, model: nn.Module, path: object) -> dict:
            out = load_weights(par, model, path)
            self.check_module(model, "after load_weights")
            return out

        handle = register_optimizer_step_post_hook(lambda opt, args, kwargs: self.check_step(opt))
        try:
            with (
                mock.patch.object(paratrain.Parallel, "prepare_model", prepared),
                mock.patch.object(paratrain.Parallel, "load_weights", loaded),
            ):
                yield
        finally:
            handle.remove()

    def check_module(self, model: nn.Module, when: str) -> None:
        self._check_current(when)
        for name, p in model.named_parameters():
            self._check(p, self.home, f"parameter {name} {when}")
        for name, b in model.named_buffers():
            self._check(b, self.device, f"buffer {name} {when}")

    def check_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.steps += 1
        self._check_current(f"at optimizer step {self.steps}")
        for i, group in enumerate(optimizer.param_groups):
            for j, p in enumerate(group["params"]):
                where = f"param_groups[{i}][{j}] {tuple(p.shape)} at step {self.steps}"
                self._check(p, self.home, f"parameter {where}")
                if p.grad is not None:
                    self._check(p.grad, self.home, f"gradient of {where}")
                for key, value in optimizer.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:  # scalar step counts live on the host
                        self._check(value, self.home, f"optimizer state {key!r} of {where}")

    def _check(self, t: torch.Tensor, want: torch.device, what: str) -> None:
        local = t.to_local() if isinstance(t, DTensor) else t
        if local.device != want:
            self._note(f"{what} on {local.device}, not {want}")
        elif isinstance(t, DTensor) and t.device_mesh.device_type != want.type:
            self._note(f"{what} on a {t.device_mesh.device_type} mesh, not {want.type}")

    def _check_current(self, when: str) -> None:
        if self.device.type == "cuda" and torch.cuda.current_device() != self.local_rank:
            self._note(f"current CUDA device {torch.cuda.current_device()} {when}, not {self.local_rank}")

    def _note(self, problem: str) -> None:
        if len(self.misplaced) < KEPT and problem not in self.misplaced:
            self.misplaced.append(problem)
