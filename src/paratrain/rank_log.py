"""The training logger: records that say which rank wrote them, on whatever ``sys.stderr`` is at the time."""

from __future__ import annotations

import logging
import sys

from .env import ClusterEnv


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of the record (it may be redirected later)."""

    @property  # type: ignore[override]
    def stream(self):  # noqa: D401
        return sys.stderr

    @stream.setter
    def stream(self, _value: object) -> None:
        pass


def rank_logger(env: ClusterEnv) -> logging.LoggerAdapter:
    """A logger whose records say which rank wrote them."""
    logger = logging.getLogger("paratrain.train")
    if not logger.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s [rank %(rank)s/%(world)s] %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logging.LoggerAdapter(logger, {"rank": env.rank, "world": env.world_size})
