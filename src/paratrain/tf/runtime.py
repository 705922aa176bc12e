"""Inside a TensorFlow worker: the ``tf.distribute`` strategy for this job, the global batch, the scaled learning
rate and an explicit auto-shard policy.

Each reads what the launcher handed over (``TF_CONFIG``), so one script runs unchanged as one process, as one
process over several GPUs, and as N workers under ``paratrain run --tf``. TensorFlow is imported on first use only,
after :func:`~paratrain.tf.install.apply_keras_choice` has picked the Keras.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import ConfigError
from ..lr import scale_lr
from .config import TF_CONFIG_VAR, TFConfig, parse_tf_config
from .install import apply_keras_choice, require_tensorflow

CHECKPOINT_DIR_VAR = "PARATRAIN_CHECKPOINT_DIR"
RESTART_VAR = "PARATRAIN_RESTART_COUNT"
SHARD_POLICIES = ("DATA", "FILE", "AUTO", "OFF")


def import_tf() -> Any:
    """``tensorflow``, imported after the Keras choice is in the environment (one line when it is missing)."""
    require_tensorflow()
    apply_keras_choice()
    import tensorflow as tf

    return tf


def tf_config() -> TFConfig | None:
    """This process's ``TF_CONFIG``, checked, or None when it has none (a single process)."""
    text = os.environ.get(TF_CONFIG_VAR, "").strip()
    return parse_tf_config(text) if text else None


def num_workers() -> int:
    """Training processes in the job (1 without ``TF_CONFIG``)."""
    config = tf_config()
    return config.num_workers if config else 1


def is_chief() -> bool:
    """True on the worker that should write logs, plots and exports (worker 0, or the chief task)."""
    config = tf_config()
    return config is None or config.rank == 0


def strategy(*, logical_cpus: int | None = None) -> Any:
    """The ``tf.distribute`` strategy for this process: ``MultiWorkerMirroredStrategy`` when ``TF_CONFIG`` lists
    several workers, ``MirroredStrategy`` for one worker with several GPUs (or ``logical_cpus`` CPU replicas),
    the default strategy otherwise. Call it first: TensorFlow refuses to set up collectives after any op ran."""
    tf = import_tf()
    if num_workers() > 1:
        return tf.distribute.MultiWorkerMirroredStrategy()
    if logical_cpus is not None and logical_cpus > 1:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * logical_cpus)
        return tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(logical_cpus)])
    if len(tf.config.list_physical_devices("GPU")) > 1:
        return tf.distribute.MirroredStrategy()
    return tf.distribute.get_strategy()


def global_batch(per_replica: int, strategy: Any = None) -> int:
    """The batch the whole job takes per step: ``per_replica`` × the replicas in sync (what ``model.fit`` and
    ``tf.data`` under a strategy expect as the dataset's batch)."""
    if per_replica < 1:
        raise ConfigError(f"per-replica batch must be >= 1, got {per_replica}")
    return per_replica * _replicas(strategy)


def scaled_lr(base_lr: float, rule: str = "linear", strategy: Any = None) -> float:
    """``base_lr`` (tuned on one replica) scaled for the replicas in sync: ``linear`` (× k) or ``sqrt`` (× √k)."""
    return scale_lr(base_lr, _replicas(strategy), rule)


def auto_shard(dataset: Any, policy: str = "DATA") -> Any:
    """``dataset`` with its auto-shard policy set explicitly, so each worker reads its share and says which.

    ``DATA`` (the default here) shards elements: right for generated or in-memory data; ``FILE`` shards input files
    (needs at least as many files as workers); ``OFF`` when the data is already split per worker."""
    tf = import_tf()
    name = policy.upper()
    if name not in SHARD_POLICIES:
        raise ConfigError(f"unknown auto-shard policy {policy!r}; choose one of: {', '.join(SHARD_POLICIES)}")
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = getattr(tf.data.experimental.AutoShardPolicy, name)
    return dataset.with_options(options)


def backup_dir(default: str | None = None) -> str | None:
    """Where ``BackupAndRestore`` should keep its state: ``paratrain run --tf --checkpoint-dir D``'s D, else
    ``default``. A restarted job resumes from it at the epoch it lost."""
    return os.environ.get(CHECKPOINT_DIR_VAR) or default


def restart_count() -> int:
    """0 on a job's first attempt, k on its k-th restart."""
    value = os.environ.get(RESTART_VAR, "0")
    return int(value) if value.isdigit() else 0


def _replicas(strategy: Any) -> int:
    if strategy is None:
        tf = import_tf()
        strategy = tf.distribute.get_strategy()
    return int(strategy.num_replicas_in_sync)
