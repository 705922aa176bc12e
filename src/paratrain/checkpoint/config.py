"""Where and how often a job checkpoints itself, from ``Parallel(...)`` arguments or the launcher's environment.

``paratrain run --checkpoint-dir D --checkpoint-every N [--resume]`` exports these as environment variables, so
a script that only says ``Parallel()`` checkpoints and resumes without a code change.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import ConfigError

ENV_DIR = "PARATRAIN_CHECKPOINT_DIR"
ENV_EVERY = "PARATRAIN_CHECKPOINT_EVERY"
ENV_KEEP = "PARATRAIN_CHECKPOINT_KEEP"
ENV_RESUME = "PARATRAIN_RESUME"
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
    after a failure (``TORCHELASTIC_RESTART_COUNT`` > 0); False: never."""

    def __post_init__(self) -> None:
        if self.every is not None and self.every < 1:
            raise ConfigError(f"checkpoint_every must be >= 1, got {self.every}")
        if self.every is not None and not self.dir:
            raise ConfigError("checkpoint_every needs a checkpoint directory; set checkpoint_dir (--checkpoint-dir)")
        if self.keep < 1:
            raise ConfigError(f"keep_checkpoints must be >= 1, got {self.keep}")
        if self.resume and not self.dir:
            raise ConfigError("resume needs a checkpoint directory; set checkpoint_dir (--checkpoint-dir)")

    @classmethod
    def resolve(cls, *, dir: str | os.PathLike | None, every: int | None, keep: int | None, resume: bool | None,
                environ: Mapping[str, str] | None = None) -> "CheckpointConfig":
        """Explicit arguments first, then the launcher's variables, then the defaults."""
        env = os.environ if environ is None else environ
        if dir is None:
            dir = env.get(ENV_DIR) or None
        if every is None and env.get(ENV_EVERY):
            every = _int(env, ENV_EVERY)
        if keep is None:
            keep = _int(env, ENV_KEEP) if env.get(ENV_KEEP) else DEFAULT_KEEP
        if resume is None and env.get(ENV_RESUME):
            resume = env[ENV_RESUME].lower() in ("1", "true", "yes")
        return cls(dir=None if dir is None else os.fspath(dir), every=every, keep=keep, resume=resume)

    def should_resume(self, environ: Mapping[str, str] | None = None) -> bool:
        """Whether the job starts from the latest checkpoint (when one exists)."""
        if not self.dir or self.resume is False:
            return False
        if self.resume:
            return True
        env = os.environ if environ is None else environ
        return env.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0")

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
        return out


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise ConfigError(f"{key}={env[key]!r} is not an integer") from None
