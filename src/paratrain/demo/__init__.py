"""The demo: a small CNN trained on scikit-learn's handwritten digits with paratrain (``paratrain demo``).

:mod:`.config` holds its options (``DemoConfig``, without torch: TensorFlow's demo job reads them too),
:mod:`.command` starts the job on N processes, :mod:`.job` is what each process runs (``python -m paratrain.demo``).
Names load on first use, so importing the config imports no torch.
"""

from __future__ import annotations

from ..lazy import lazy_getattr

_EXPORTS = {"DemoConfig": ".config", "run_demo": ".command", "main": ".job"}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
