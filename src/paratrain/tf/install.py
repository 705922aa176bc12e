"""Whether TensorFlow is installed, and which Keras its workers get, found without importing TensorFlow.

The Keras choice (measured on TensorFlow 2.21, CPU, two local workers): Keras 3, the default ``tf.keras``, cannot
run ``model.fit`` under ``MultiWorkerMirroredStrategy`` (``PerReplica … unsupported type``, keras-team/keras#20585);
tf-keras, the Keras 2 that TensorFlow still ships separately, can, and gives the same weights as Keras 3 in one
process. TensorFlow switches ``tf.keras`` to tf-keras when ``TF_USE_LEGACY_KERAS=1`` is set *before* it is
imported, so the launcher sets it in the workers' environment (never a user's explicit value) and says so once.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from ..errors import ConfigError

INSTALL_HINT = "TensorFlow is not installed: pip install 'paratrain[tf]' (TensorFlow 2.21 and tf-keras)"
LEGACY_KERAS_VAR = "TF_USE_LEGACY_KERAS"


def installed(module: str) -> bool:
    """True when ``module`` can be imported here (looked up, not imported)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: sys.modules[module] is None (blocked on purpose)
        return False


def require_tensorflow() -> None:
    """Raise the one-line install hint when TensorFlow is missing."""
    if not installed("tensorflow"):
        raise ConfigError(INSTALL_HINT)


@dataclass(frozen=True)
class KerasChoice:
    """Which Keras ``tf.keras`` will be in the workers, and why."""

    legacy: bool
    """True: tf-keras (Keras 2) through ``TF_USE_LEGACY_KERAS=1``; False: Keras 3."""
    set_by_us: bool
    """True when the launcher sets ``TF_USE_LEGACY_KERAS`` (the user had not)."""

    @property
    def name(self) -> str:
        return "tf-keras (Keras 2, TF_USE_LEGACY_KERAS=1)" if self.legacy else "Keras 3"

    def note(self, workers: int) -> str | None:
        """The one line the launcher prints about it, or None when there is nothing to say."""
        if self.legacy and self.set_by_us:
            return (
                "TF_USE_LEGACY_KERAS=1 for the workers: tf.keras is tf-keras, since Keras 3's model.fit fails "
                "under MultiWorkerMirroredStrategy (keras#20585); set TF_USE_LEGACY_KERAS=0 to keep Keras 3"
            )
        if not self.legacy and workers > 1:
            return (
                "warning: tf.keras is Keras 3, whose model.fit fails under MultiWorkerMirroredStrategy "
                "(keras#20585); pip install 'paratrain[tf]' (tf-keras) or unset TF_USE_LEGACY_KERAS=0"
            )
        return None


def keras_choice(environ: Mapping[str, str] | None = None) -> KerasChoice:
    """tf-keras when it is installed and the user did not choose, else what the user's variable says."""
    env = os.environ if environ is None else environ
    given = env.get(LEGACY_KERAS_VAR)
    if given is not None and given != "":
        return KerasChoice(legacy=given.strip().lower() in ("1", "true", "yes"), set_by_us=False)
    return KerasChoice(legacy=installed("tf_keras"), set_by_us=installed("tf_keras"))


def apply_keras_choice(environ: MutableMapping[str, str] | None = None) -> KerasChoice:
    """Decide the Keras and write it into ``environ`` (default: this process's), before TensorFlow is imported."""
    env = os.environ if environ is None else environ
    choice = keras_choice(env)
    if choice.set_by_us:
        env[LEGACY_KERAS_VAR] = "1"
    return choice
