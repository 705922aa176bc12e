"""The one place ``paratrain verify train.py`` reaches into a training script: ``Parallel``'s constructor.

``paratrain verify`` launches the unchanged script with :data:`VAR` set (as ``paratrain run`` launches it), and runs
it once more in one process for the reference. There, :func:`hold` hands every ``Parallel`` the script builds to
verify (:mod:`paratrain.verify.script`), which picks the strategy and records (or replays) the training steps;
elsewhere nothing holds it and the constructor runs as written.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

VAR = "PARATRAIN_VERIFY_SCRIPT"
"""Set by ``paratrain verify`` for the ranks of the script it launches: JSON saying what to record (the package's
``__init__`` reads it and has verify hold the constructor)."""

TakeOver = Callable[[Callable[..., None], Any, tuple, dict], None]
"""``take_over(init, par, args, kwargs)``: builds ``par`` with ``init`` its own way."""

_held: TakeOver | None = None


def hold(take_over: TakeOver | None) -> TakeOver | None:
    """From now on every ``Parallel`` is built by ``take_over`` (None: as written); returns the previous holder."""
    global _held
    previous, _held = _held, take_over
    return previous


def verified(init: Callable[..., None]) -> Callable[..., None]:
    """``Parallel.__init__``, handed to verify's holder while one holds it."""

    @functools.wraps(init)
    def construct(self: Any, *args: Any, **kwargs: Any) -> None:
        if _held is None:
            return init(self, *args, **kwargs)
        return _held(init, self, args, kwargs)

    return construct
