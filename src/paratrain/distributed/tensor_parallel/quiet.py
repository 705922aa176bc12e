"""Silence DTensor's advice about two sequential collectives where paratrain itself reduces over a 2-D mesh.

A gradient norm over ``(dp, tp)`` shards, or a full state dict gathered from FSDP x TP parameters, makes DTensor
reduce or gather one mesh dimension after the other, and torch logs a warning on every rank each time. For a
scalar norm once a step and a state dict once a run the cost is nothing, while the warning (one per rank and call)
buried the training output; the user's own redistributions still warn.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

_LOGGER = "torch.distributed.tensor._redistribute"


class _SequentialCollectives(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "sequential" not in record.getMessage()


@contextmanager
def quiet_sequential_collectives() -> Iterator[None]:
    """Inside: DTensor's 'N sequential all_reduce/all_gather operations' warnings are dropped."""
    logger, only = logging.getLogger(_LOGGER), _SequentialCollectives()
    logger.addFilter(only)
    try:
        yield
    finally:
        logger.removeFilter(only)
