"""The one place ``paratrain verify train.py`` reaches into a training script: ``Parallel``'s constructor.

``paratrain verify`` launches the unchanged script with :data:`VAR` set (as ``paratrain run`` launches it), and runs
it once more in one process for the reference. Where the variable is set, every ``Parallel`` the script builds is
handed to :func:`paratrain.verify.script.take_over`, which picks the strategy and records (or replays) the training
steps; elsewhere the constructor runs as written, and nothing of verify is imported.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

VAR = "PARATRAIN_VERIFY_SCRIPT"
"""Set by ``paratrain verify`` for the script it checks: JSON saying which run this is (see the module above)."""


def verified(init: Callable[..., None]) -> Callable[..., None]:
    """``Parallel.__init__``, handed to verify when the script runs under ``paratrain verify``."""

    @functools.wraps(init)
    def construct(self: Any, *args: Any, **kwargs: Any) -> None:
        setting = os.environ.get(VAR)
        if not setting:
            return init(self, *args, **kwargs)
        from .verify.script import take_over

        return take_over(init, self, setting, args, kwargs)

    return construct
