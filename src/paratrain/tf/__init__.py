"""paratrain's TensorFlow extra (``pip install 'paratrain[tf]'``): Keras ``tf.distribute`` jobs launched,
checked and recovered by paratrain.

``paratrain run --tf -n 2 train.py`` hands each worker its ``TF_CONFIG``; inside the script::

    import paratrain.tf as ptf
    strategy = ptf.strategy()                     # MultiWorkerMirroredStrategy / MirroredStrategy / default
    batch = ptf.global_batch(64, strategy)        # 64 per replica
    lr = ptf.scaled_lr(1e-3, "linear", strategy)

Importing this package imports neither TensorFlow nor torch: names load on first use, and TensorFlow is
imported only after the Keras choice is in the environment (:mod:`paratrain.tf.install`). TensorFlow never runs in
a process that imports torch: the launcher, doctor, verify and bench start TensorFlow in processes of their own.
"""

from __future__ import annotations

from ..lazy import lazy_getattr

_EXPORTS = {
    "strategy": ".runtime",
    "global_batch": ".runtime",
    "scaled_lr": ".runtime",
    "auto_shard": ".runtime",
    "backup_dir": ".runtime",
    "restart_count": ".runtime",
    "num_workers": ".runtime",
    "is_chief": ".runtime",
    "tf_config": ".runtime",
    "import_tf": ".runtime",
    "TFConfig": ".config",
    "parse_tf_config": ".config",
    "keras_choice": ".install",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
