"""``Parallel``'s keywords, parsed once: the common case flat, the rest in the config objects that hold them.

``Parallel("zero3", precision="bf16-mixed", accumulate=4, clip_grad_norm=1.0, seed=0, checkpoint="ckpt",
log_with="tensorboard")`` is the common case. What fewer scripts set is grouped: what paratrain does to the model
(:class:`ModelConfig`), how this process joins and waits for the job (:class:`JobConfig`), the batch of one optimizer
step (``accumulate=GlobalBatch(256, micro=8)``). The keywords left over are the strategy's own options, read by the
strategy's spec alone. The former flat spellings still work, with one warning naming what to write instead.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .checkpoint.config import CheckpointConfig, checkpoint_config
from .distributed.router_loss import MODES
from .env import ClusterEnv
from .errors import ConfigError
from .guard import GuardConfig, guard_config
from .loop import GlobalBatch
from .loss import HeadLoss
from .options import BlockTransforms


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """What ``prepare`` does to the model beside the strategy (``Parallel(model=ModelConfig(...))``)."""

    activation_checkpointing: bool | int = False
    """Recompute each block's activations in backward (True), every k-th block's (k), or none (False)."""
    compile: bool | Mapping[str, Any] = False
    """``torch.compile`` each block (True, or a dict of its options); :mod:`paratrain.model.transforms`."""
    init_fn: Callable[[nn.Module], None] | str | None = None
    """Initializes a model built on the meta device (:mod:`paratrain.model.materialize`)."""
    loss_chunk: int | None = None
    """Compute the cross-entropy at the model's head, this many tokens at a time (:mod:`paratrain.loss`)."""

    def __post_init__(self) -> None:
        self.transforms  # noqa: B018  (a bad value is refused here, in one line)
        HeadLoss(self.loss_chunk)

    @property
    def transforms(self) -> BlockTransforms:
        """Activation checkpointing and compilation of the model's blocks."""
        return BlockTransforms.of(self.activation_checkpointing, self.compile)


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """How this process joins the job and waits for its peers (``Parallel(job=JobConfig(...))``)."""

    timeout_s: float = 300.0
    """How long a collective waits for every rank before the job fails, naming who is missing."""
    wait_report_s: float | None = None
    """After how long a wait says who is missing (:mod:`paratrain.call_watch`; None: its default)."""
    env: ClusterEnv | None = None
    """Where this process sits; read from the environment (torchrun's variables) when None."""
    deterministic: bool = False
    """Deterministic kernels: bitwise-repeatable GPU runs, at some speed."""

    def __post_init__(self) -> None:
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or self.timeout_s <= 0:
            raise ConfigError(f"JobConfig.timeout_s must be a number of seconds > 0, got {self.timeout_s!r}")


MOVED: dict[str, str] = {
    "activation_checkpointing": "model",
    "compile": "model",
    "init_fn": "model",
    "loss_chunk": "model",
    "timeout_s": "job",
    "wait_report_s": "job",
    "env": "job",
    "deterministic": "job",
    "global_batch": "accumulate",
    "micro_batch": "accumulate",
}
"""``Parallel``'s former flat keywords → the keyword whose config now holds them."""


@dataclass(kw_only=True)
class Settings:
    """Everything ``Parallel``'s keywords say, each in its one object."""

    model: ModelConfig
    job: JobConfig
    accumulate: int
    batch: GlobalBatch | None
    checkpoint: CheckpointConfig
    moe_aux_loss: str
    """How a mixture of experts' router loss is computed (:mod:`paratrain.distributed.router_loss`)."""
    guard: GuardConfig | None = None
    """The numerics guard's settings (:mod:`paratrain.guard`), None when off."""
    strategy_options: dict[str, Any] = field(default_factory=dict)
    """What is left: the strategy's own options (``bucket_cap_mb``, ``tp``, ``config``…), for its spec alone."""

    @classmethod
    def parse(
        cls,
        *,
        accumulate: int | GlobalBatch,
        model: ModelConfig | None,
        job: JobConfig | None,
        checkpoint: CheckpointConfig | str | os.PathLike | None,
        options: dict[str, Any],
        guard: bool | GuardConfig | None = None,
    ) -> Settings:
        """``Parallel``'s grouped keywords and its ``**options``, where the former flat spellings may still be
        (one warning naming what to write instead)."""
        former = {k: v for k, v in options.items() if k in MOVED}
        if former:
            warnings.warn(
                f"Parallel({', '.join(f'{k}=' for k in former)}) is deprecated; write {_spelling(former)}",
                FutureWarning,
                stacklevel=4,  # parse, Parallel.__init__, its paratrain.script_verify wrapper, the user
            )
        for name, value, config in (("model", model, ModelConfig), ("job", job, JobConfig)):
            if value is not None and not isinstance(value, config):
                raise ConfigError(f"{name}= takes a paratrain.{config.__name__}(...), got {type(value).__name__}")
        options = regroup({**options, "accumulate": accumulate, "model": model, "job": job})
        accumulate, model, job = options.pop("accumulate"), options.pop("model"), options.pop("job")
        moe_aux_loss = options.pop("moe_aux_loss", "local")
        if moe_aux_loss not in MODES:
            raise ConfigError(f"moe_aux_loss must be one of {', '.join(map(repr, MODES))}, not {moe_aux_loss!r}")
        batch = accumulate if isinstance(accumulate, GlobalBatch) else None
        return cls(
            model=model or ModelConfig(),
            job=job or JobConfig(),
            batch=batch,
            moe_aux_loss=moe_aux_loss,
            accumulate=1 if batch is not None else accumulate,
            checkpoint=checkpoint_config(checkpoint, options),
            guard=guard_config(guard),
            strategy_options=options,
        )


def regroup(options: Mapping[str, Any]) -> dict[str, Any]:
    """``Parallel``'s keywords ``options`` with the former flat ones moved into ``model=``, ``job=`` and
    ``accumulate=`` (each None or 1 when not given); a setting given both ways is refused in one line."""
    out = {"accumulate": 1, "model": None, "job": None, **options}
    moved = {k: out.pop(k) for k in list(out) if k in MOVED}
    for keyword, config in (("model", ModelConfig), ("job", JobConfig)):
        mine = {k: v for k, v in moved.items() if MOVED[k] == keyword}
        if mine and out[keyword] is not None:
            raise ConfigError(
                f"Parallel got {keyword}= and the former {', '.join(f'{k}=' for k in mine)}; give "
                f"them all in {keyword}="
            )
        if mine:
            out[keyword] = config(**mine)
    if "global_batch" in moved or "micro_batch" in moved:
        batch = GlobalBatch.of(moved.get("global_batch"), moved.get("micro_batch"))
        if batch is None:  # global_batch=None: no global batch, as before
            return out
        if out["accumulate"] != 1:
            raise ConfigError(
                f"accumulate={out['accumulate']!r} given with global_batch={batch.size}; give one of "
                "them (with a global batch, accumulate follows from the layout)"
            )
        out["accumulate"] = batch
    return out


def _spelling(former: dict[str, Any]) -> str:
    """What to write instead of the former keywords, e.g. ``job=paratrain.JobConfig(timeout_s=60)``."""
    spelled = []
    for keyword, config in (("model", "ModelConfig"), ("job", "JobConfig")):
        fields = ", ".join(f"{k}={v!r}" for k, v in former.items() if MOVED[k] == keyword)
        if fields:
            spelled.append(f"{keyword}=paratrain.{config}({fields})")
    if "global_batch" in former:
        micro = f", micro={former['micro_batch']!r}" if former.get("micro_batch") is not None else ""
        spelled.append(f"accumulate=paratrain.GlobalBatch({former['global_batch']!r}{micro})")
    return ", ".join(spelled) or "accumulate=paratrain.GlobalBatch(size, micro=...)"
