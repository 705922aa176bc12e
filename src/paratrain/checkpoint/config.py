"""Where and how often a job checkpoints itself, from ``Parallel(...)`` arguments or the launcher's environment.

``paratrain run --checkpoint-dir D --checkpoint-every N [--checkpoint-async] [--resume]`` exports these as
environment variables, so a script that only says ``Parallel()`` checkpoints and resumes without a code change.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..preemption import DEFAULT_CHECK_EVERY

ENV_DIR = "PARATRAIN_CHECKPOINT_DIR"
ENV_EVERY = "PARATRAIN_CHECKPOINT_EVERY"
ENV_KEEP = "PARATRAIN_CHECKPOINT_KEEP"
ENV_RESUME = "PARATRAIN_RESUME"
ENV_ASYNC = "PARATRAIN_CHECKPOINT_ASYNC"
DEFAULT_KEEP = 3


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Automatic checkpointing and resuming of a ``Parallel`` job."""

    dir: str | None = None
    """Root directory of the job's checkpoints (``step-XXXXXXXX`` folders and a ``latest`` pointer)."""
    every: int | None = None
    """Save automatically after every this many optimizer steps (None: only when ``par.save`` is called)."""
    keep: int = DEFAULT_KEEP
    """How many of the newest checkpoints to keep; older ones are deleted once a newer one is complete."""
    resume: bool | None = None
    """True: start from ``dir``'s latest checkpoint when there is one; None: only when torchrun restarted the job
    after a failure (``TORCHELASTIC_RESTART_COUNT`` > 0) or SLURM requeued it (``SLURM_RESTART_COUNT`` > 0: after a
    preemption, :mod:`paratrain.preemption`); False: never."""
    async_save: bool = False
    """Write the automatic saves in the background while training goes on (``par.save(async_save=True)``)."""
    stop_check_every: int = DEFAULT_CHECK_EVERY
    """Optimizer steps between the ranks' checks for a stop signal (SIGTERM, SIGUSR1): on one, every rank saves at
    the same step and exits restartable (:mod:`paratrain.preemption`)."""

    def __post_init__(self) -> None:
        if self.every is not None and self.every < 1:
            raise ConfigError(f"checkpoint every must be >= 1, got {self.every}")
        if self.keep < 1:
            raise ConfigError(f"checkpoint keep must be >= 1, got {self.keep}")
        if not isinstance(self.stop_check_every, int) or self.stop_check_every < 1:
            raise ConfigError(f"checkpoint stop_check_every must be an integer >= 1, got {self.stop_check_every!r}")

    def checked(self) -> CheckpointConfig:
        """The job's configuration, complete: what needs a directory has one (``paratrain run --checkpoint-dir``
        may give it, so a config of the script's own may lack it)."""
        for what, needs in (
            ("every", self.every is not None),
            ("resume", bool(self.resume)),
            ("async_save", self.async_save),
        ):
            if needs and not self.dir:
                raise ConfigError(
                    f"checkpoint {what} needs a checkpoint directory; give CheckpointConfig(dir=...) "
                    "(or paratrain run --checkpoint-dir)"
                )
        return self

    @classmethod
    def of(
        cls, spec: CheckpointConfig | str | os.PathLike | None, environ: Mapping[str, str] | None = None
    ) -> CheckpointConfig:
        """``Parallel(checkpoint=spec)``: a config, a directory (the rest default), or None; what it leaves unset
        (``dir``, ``every``, ``resume`` None; ``keep``, ``async_save`` at their defaults) comes from ``paratrain
        run``'s variables."""
        if spec is None or isinstance(spec, (str, os.PathLike)):
            return cls.from_environ(dir=spec, every=None, keep=None, resume=None, environ=environ)
        if not isinstance(spec, CheckpointConfig):
            raise ConfigError(
                f"checkpoint must be a directory or a paratrain.CheckpointConfig, got {type(spec).__name__}"
            )
        return cls.from_environ(
            dir=spec.dir,
            every=spec.every,
            keep=None if spec.keep == DEFAULT_KEEP else spec.keep,
            resume=spec.resume,
            async_save=spec.async_save or None,
            environ=environ,
            stop_check_every=spec.stop_check_every,
        )

    @classmethod
    def from_environ(
        cls,
        *,
        dir: str | os.PathLike | None,
        every: int | None,
        keep: int | None,
        resume: bool | None,
        async_save: bool | None = None,
        environ: Mapping[str, str] | None = None,
        stop_check_every: int = DEFAULT_CHECK_EVERY,
    ) -> CheckpointConfig:
        """Explicit arguments first, then the launcher's variables, then the defaults."""
        env = os.environ if environ is None else environ
        if dir is None:
            dir = env.get(ENV_DIR) or None
        if every is None and env.get(ENV_EVERY):
            every = _int(env, ENV_EVERY)
        if keep is None:
            keep = _int(env, ENV_KEEP) if env.get(ENV_KEEP) else DEFAULT_KEEP
        if resume is None and env.get(ENV_RESUME):
            resume = _yes(env[ENV_RESUME])
        if async_save is None:
            async_save = _yes(env.get(ENV_ASYNC, ""))
        return cls(
            dir=None if dir is None else os.fspath(dir),
            every=every,
            keep=keep,
            resume=resume,
            async_save=async_save,
            stop_check_every=stop_check_every,
        ).checked()

    def should_resume(self, environ: Mapping[str, str] | None = None) -> bool:
        """Whether the job starts from the latest checkpoint (when one exists)."""
        if not self.dir or self.resume is False:
            return False
        if self.resume:
            return True
        env = os.environ if environ is None else environ
        return any(env.get(var, "0") not in ("", "0") for var in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))

    def environ(self) -> dict[str, str]:
        """The variables that hand this configuration to every rank of a launched job."""
        out = {}
        if self.dir:
            out[ENV_DIR] = os.path.abspath(self.dir)
        if self.every is not None:
            out[ENV_EVERY] = str(self.every)
        if self.keep != DEFAULT_KEEP:
            out[ENV_KEEP] = str(self.keep)
        if self.resume is not None:
            out[ENV_RESUME] = "1" if self.resume else "0"
        if self.async_save:
            out[ENV_ASYNC] = "1"
        return out


def _yes(value: str) -> bool:
    return value.lower() in ("1", "true", "yes")


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise ConfigError(f"{key}={env[key]!r} is not an integer") from None


OLD_KEYWORDS = {"checkpoint_dir": "dir", "checkpoint_every": "every", "keep_checkpoints": "keep", "resume": "resume"}
"""``Parallel``'s former checkpoint keywords → ``CheckpointConfig``'s fields."""


def checkpoint_config(
    checkpoint: CheckpointConfig | str | os.PathLike | None, options: dict[str, Any]
) -> CheckpointConfig:
    """``Parallel(checkpoint=...)``'s configuration; the former keywords (taken out of ``options``) still work, with
    one warning each saying what to write instead."""
    old = {OLD_KEYWORDS[k]: options.pop(k) for k in list(options) if k in OLD_KEYWORDS}
    if not old:
        return CheckpointConfig.of(checkpoint)
    if checkpoint is not None:
        raise ConfigError(f"checkpoint= given beside {sorted(old)}; put them all in CheckpointConfig")
    fields = ", ".join(f"{k}={v!r}" for k, v in old.items())
    warnings.warn(
        f"Parallel's checkpoint keywords are deprecated; write checkpoint=paratrain.CheckpointConfig({fields})",
        FutureWarning,
        stacklevel=3,
    )
    return CheckpointConfig.from_environ(**{"dir": None, "every": None, "keep": None, "resume": None, **old})
