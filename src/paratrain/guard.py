"""The numerics guard (``Parallel(guard=True)``, or ``guard=GuardConfig(...)``): an optimizer step whose loss or
gradient norm is not finite, or whose loss spikes, is skipped on every rank alike; after a run of skips the job
reloads its last checkpoint and reads on past the batches that caused them (docs/parallel.md, "The numerics guard").

Every rank must take the same decision, or the replicas part ways (or a collective waits forever). It is therefore
taken only from values already reduced over the job: the global gradient norm (over every shard, stage and
tensor-parallel slice, as clipping takes it) and the step's loss averaged over every rank that trains (a
pipeline's last stage hands its loss to every stage first). A NaN or inf on one rank reaches both through the
reduction, so every rank sees the same flag.

Host reads. The decision is one 0-d flag on the device, read once per optimizer step (``bool(flag)``), before the
optimizer steps; nothing else of the guard reads the device on a step that is kept. The read is needed: torch's
default optimizers on CUDA (``foreach``) can only skip by not being called, and a skip must be counted, named and,
after a run of them, answered by a reload, all on the host and in the step that is skipped (its gradients name the
parameter; they are gone a step later). torch's ``GradScaler`` skips a *fused* Adam/AdamW/SGD without a branch by
handing it ``found_inf``, but it too reads the flag for every other optimizer; Megatron-LM's and DeepSpeed's skips
read theirs each step as well. One read of one value per step costs the device the time the host takes to queue the
optimizer step (measured: benchmarks/guard_overhead.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .checkpoint import layout
from .distributed.metrics import gather_object, reduce_value
from .errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class GuardConfig:
    """What the numerics guard skips and when it reloads (``Parallel(guard=GuardConfig(...))``; ``guard=True``: these
    defaults)."""

    spike: float | None = None
    """Also skip a step whose loss exceeds this many times the median loss of the last ``window`` kept steps (for
    losses > 0; None: only non-finite values are skipped)."""
    window: int = 50
    """Kept steps whose losses make the median; the spike check starts once that many were kept."""
    reload_after: int | None = 3
    """Skipped steps in a row after which the job reloads its last checkpoint (None: never)."""

    def __post_init__(self) -> None:
        spike = self.spike
        if spike is not None and (isinstance(spike, bool) or not isinstance(spike, (int, float)) or not spike > 1):
            raise ConfigError(f"GuardConfig.spike must be a ratio > 1 (or None), got {self.spike!r}")
        for name in ("window", "reload_after"):
            value = getattr(self, name)
            if (value is not None or name == "window") and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1
            ):
                raise ConfigError(f"GuardConfig.{name} must be an integer >= 1, got {value!r}")


def guard_config(value: bool | GuardConfig | None) -> GuardConfig | None:
    """``Parallel``'s ``guard=``: None when off."""
    if value is None or value is False:
        return None
    if value is True:
        return GuardConfig()
    if not isinstance(value, GuardConfig):
        raise ConfigError(f"guard= takes True, False or a paratrain.GuardConfig(...), got {type(value).__name__}")
    return value


class Guard:
    """The guard of one ``Parallel`` (``par``, typed ``Any``: the façade imports this module), whose strategy,
    trackers, monitor and checkpoints it reads."""

    def __init__(self, config: GuardConfig, par: Any) -> None:
        self.config, self._par = config, par
        self.skipped = 0
        """Optimizer steps skipped so far."""
        self.in_a_row = 0
        """Steps skipped since the last kept one (or reload)."""
        self.reloads = 0
        """Checkpoints reloaded after ``reload_after`` skips in a row."""
        self.lines: list[str] = []
        """The lines said about each skip (the same on every rank; rank 0 prints them)."""
        self._losses: dict[int, torch.Tensor] = {}
        self._history: torch.Tensor | None = None
        self._kept = 0

    @classmethod
    def of(cls, config: GuardConfig | None, par: Any) -> Guard | None:
        """``par``'s guard, None when ``config`` is (the guard is off)."""
        return None if config is None else cls(config, par)

    def saw(self, micro_step: int, loss: torch.Tensor) -> torch.Tensor:
        """Keep the loss of micro-step ``micro_step`` (the last given for it counts) and hand it back."""
        self._losses[micro_step] = loss.detach()
        return loss

    def skips(
        self, strategy: Any, model: nn.Module, optimizer: torch.optim.Optimizer, norm: torch.Tensor | None
    ) -> bool:
        """Whether the step ending now is skipped, from the global gradient ``norm`` (None: not checked) and the
        micro-steps' losses; a skip is counted, said and, after ``reload_after`` in a row, answered by a reload."""
        if strategy.server.serves:
            raise ConfigError(
                f"the numerics guard does not run under {strategy.name}: the servers step on gradients no worker "
                "sees whole; drop guard="
            )
        loss = self._step_loss()
        flag = self._flag(norm, loss)
        if flag is None or not bool(flag):  # the guard's one host read per step (module docstring)
            self._keep(loss)
            return False
        self._skip(strategy, model, optimizer, norm, loss)
        return True

    def _step_loss(self) -> torch.Tensor | None:
        """The step's loss: its micro-steps' mean, averaged over every rank that trains (None: none given). The
        ranks of a pipeline or a tensor-parallel group hold their replica's loss alike, so this is the mean over the
        replicas; and were one of them to hold another value, every rank would still decide on the same one."""
        losses, self._losses = list(self._losses.values()), {}
        if not losses:
            return None
        par = self._par
        group = par.strategy.server.training_group(par.env)
        size = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
        return reduce_value(torch.stack(losses).float().mean(), mean=True, size=size, group=group, device=par.device)

    def _flag(self, norm: torch.Tensor | None, loss: torch.Tensor | None) -> torch.Tensor | None:
        """A 0-d bool on the device: skip this step."""
        flags = [~torch.isfinite(t) for t in (norm, loss) if t is not None]
        if loss is not None and self._armed:
            assert self._history is not None and self.config.spike is not None
            flags.append(loss > self.config.spike * self._history.median())
        device = self._par.device  # a norm over CPU-offloaded gradients lives on the host
        return torch.stack([flag.to(device) for flag in flags]).any() if flags else None

    @property
    def _armed(self) -> bool:
        return self.config.spike is not None and self._kept >= self.config.window

    def _keep(self, loss: torch.Tensor | None) -> None:
        self.in_a_row = 0
        if loss is None or self.config.spike is None:
            return
        if self._history is None:
            self._history = torch.zeros(self.config.window, device=loss.device)
        self._history[self._kept % self.config.window] = loss
        self._kept += 1

    def _skip(
        self,
        strategy: Any,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        norm: torch.Tensor | None,
        loss: torch.Tensor | None,
    ) -> None:
        par = self._par
        self.skipped, self.in_a_row = self.skipped + 1, self.in_a_row + 1
        step = par.optimizer_steps + 1
        why = self._reason(strategy, model, norm, loss)
        self.lines.append(
            f"paratrain: guard: skipped optimizer step {step} ({why}); {self.in_a_row} in a row, {self.skipped} in all"
        )
        par.print(self.lines[-1])
        par.trackers.log({"guard/skipped_steps": self.skipped}, step)
        if par.monitor is not None:
            par.monitor.skipped_steps = self.skipped
        par.precision.skipped(optimizer)
        if self.config.reload_after is not None and self.in_a_row >= self.config.reload_after:
            self._reload()

    def _reason(self, strategy: Any, model: nn.Module, norm: torch.Tensor | None, loss: torch.Tensor | None) -> str:
        """What was wrong, in words (host reads: a skipped step only)."""
        parts = []
        if loss is not None:
            value = float(loss)
            if not math.isfinite(value):
                parts.append(f"loss {value}")
            elif self._armed:
                assert self._history is not None
                median = float(self._history.median())
                if value > self.config.spike * median:  # type: ignore[operator]
                    parts.append(f"loss {value:.4g} > {self.config.spike:g} x the median {median:.4g}")
        if norm is not None and not math.isfinite(value := float(norm)):
            group = strategy.server.training_group(self._par.env)
            parts.append(f"gradient norm {value}" + first_nonfinite(strategy.unwrap(model), group))
        return "; ".join(parts)

    def _reload(self) -> None:
        """Restore the last checkpoint's model, optimizer, schedulers and scaler; the loaders and the step count
        read on from here, so the batches that caused the skips are not read again."""
        par = self._par
        folder = par.checkpoint_config.dir
        found = layout.latest(Path(folder)) if folder is not None else None
        if found is None:
            where = f"no checkpoint saved in {folder} yet" if folder is not None else "no checkpoint directory set"
            raise ConfigError(
                f"guard: {self.in_a_row} optimizer steps skipped in a row and {where} to reload; give "
                "Parallel(checkpoint=CheckpointConfig(dir=..., every=N)) or GuardConfig(reload_after=None)"
            )
        par.print(f"paratrain: guard: {self.in_a_row} steps skipped in a row; reloading {found}, reading on")
        par._checkpoints.load(replace(par._checkpoint_targets(), data=False), found)
        self.in_a_row, self.reloads = 0, self.reloads + 1


def first_nonfinite(model: nn.Module, group: dist.ProcessGroup | None) -> str:
    """``"; first non-finite gradient: NAME (rank R)"``: the first parameter, in the model's order and then the
    ranks', whose gradient (this rank's shard of it) holds a NaN or inf (collective over ``group`` when there is one;
    "" when none does)."""
    mine = None
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is not None and not bool(torch.isfinite(grad.to_local() if hasattr(grad, "to_local") else grad).all()):
            mine = name
            break
    for r, name in enumerate(gather_object(mine, group)):
        if name is not None:
            return f"; first non-finite gradient: {name} (rank {r})"
    return ""
