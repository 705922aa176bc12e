"""The TensorFlow demo job: a small Keras CNN trained on the bundled digits with ``model.fit`` under the strategy
:func:`paratrain.tf.strategy` picks (``MultiWorkerMirroredStrategy`` at ``-n 2``).

Run it with ``paratrain demo --tf``, or by hand: ``paratrain run --tf -n 2 -m paratrain.tf.demo_job --epochs 10``.
Its flags are the torch demo's (``paratrain.demo.config.DemoConfig``) that a Keras job has, and ``--out``.
With ``--checkpoint-dir`` (``paratrain run --tf --checkpoint-dir D``) it keeps ``BackupAndRestore`` state there;
``--fail-at-step E --fail-rank R`` SIGKILLs worker R after epoch E on the job's first attempt, so
``--max-restarts 1`` shows a restart resuming after the last epoch backed up, with the same final weights.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import statistics
import sys
import time

from ..demo.config import DemoConfig
from ..flags import add_flags, build
from ..progress import Progress
from . import runtime
from .demo import JOB_FIELDS


def parse(argv: list[str] | None = None) -> tuple[DemoConfig, str | None]:
    """The demo's options this job has, and where worker 0 writes the run's figures (``--out``, JSON)."""
    parser = argparse.ArgumentParser(
        prog="paratrain.tf.demo_job", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_flags(parser, DemoConfig, only=JOB_FIELDS)
    parser.add_argument("--out", help="worker 0 writes the run's figures here (JSON)")
    args = parser.parse_args(argv)
    return build(DemoConfig, args), args.out


def digits_arrays(seed: int = 0, test_fraction: float = 0.2):  # type: ignore[no-untyped-def]
    """scikit-learn's bundled digits as float32 NHWC images in [0, 1] and int labels, split as the torch demo's."""
    import numpy as np

    from ..errors import ConfigError

    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ConfigError("the digits demo needs scikit-learn: pip install 'paratrain[demo]'") from None
    bunch = load_digits()
    x = (bunch.images / 16.0).astype(np.float32)[..., None]
    y = bunch.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    cut = int(len(x) * (1 - test_fraction))
    return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]


def digits_model(tf):  # type: ignore[no-untyped-def]
    keras = tf.keras
    return keras.Sequential(
        [
            keras.layers.Input(shape=(8, 8, 1)),
            keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def weights_digest(model) -> str:  # type: ignore[no-untyped-def]
    """SHA-256 of every weight's bytes, in the model's order: equal digests, bitwise equal models."""
    h = hashlib.sha256()
    for w in model.get_weights():
        h.update(w.tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> None:
    args, out = parse(argv)
    strategy = runtime.strategy()  # first: TensorFlow refuses collectives set up after an op
    tf = runtime.import_tf()
    tf.keras.utils.set_random_seed(args.seed)
    replicas = strategy.num_replicas_in_sync
    workers, chief = runtime.num_workers(), runtime.is_chief()
    if args.batch_size % replicas:
        raise SystemExit(f"--batch-size {args.batch_size} does not split over {replicas} replicas")
    x_train, y_train, x_test, y_test = digits_arrays(args.seed)
    # Every epoch reads the same (seeded) order and ends on a batch boundary of the repeated stream: a job
    # BackupAndRestore resumes at epoch k then sees exactly the batches an uninterrupted one does.
    steps = len(x_train) // args.batch_size
    x_train, y_train = x_train[: steps * args.batch_size], y_train[: steps * args.batch_size]
    train = runtime.auto_shard(tf.data.Dataset.from_tensor_slices((x_train, y_train)).batch(args.batch_size).repeat())
    test = runtime.auto_shard(tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(args.batch_size))
    with strategy.scope():
        model = digits_model(tf)
        model.compile(
            optimizer=tf.keras.optimizers.Adam(args.lr),
            loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    callbacks = []
    backup = runtime.backup_dir()
    if backup:
        callbacks.append(tf.keras.callbacks.BackupAndRestore(backup_dir=backup))
    report = _report_callback(tf, args, steps, chief)
    callbacks.append(report)
    if chief:
        print(
            f"paratrain demo --tf: digits CNN, {len(x_train)} train / {len(x_test)} test samples, {workers} "
            f"worker(s), {replicas} replica(s), {_strategy_name(strategy)}, tf.keras = {_keras_name(tf)}",
            flush=True,
        )
    start = time.perf_counter()
    history = model.fit(
        train, epochs=args.epochs, steps_per_epoch=steps, validation_data=test, verbose=0, callbacks=callbacks
    )
    wall = time.perf_counter() - start
    _, acc = model.evaluate(test, verbose=0)
    trained = len(history.epoch)
    digest = weights_digest(model)
    if out:  # every worker: its own step times, for the summary table
        config = runtime.tf_config()
        with open(f"{out}.worker{config.rank if config else 0}", "w") as f:
            json.dump(
                {
                    "rank": config.rank if config else 0,
                    "steps": len(report.step_ms),
                    "step_ms": statistics.median(report.step_ms) if report.step_ms else 0.0,
                },
                f,
            )
    if chief:
        print(
            f"done in {wall:.2f} s  ({trained * steps * args.batch_size / wall:,.0f} samples/s over {workers} "
            f"worker(s))  final test acc {acc:.2%}",
            flush=True,
        )
        print(f"final weights sha256 {digest}", flush=True)
        if out:
            with open(out, "w") as f:
                json.dump(
                    {
                        "test_acc": float(acc),
                        "wall_s": wall,
                        "epochs_run": trained,
                        "first_epoch": history.epoch[0] + 1 if history.epoch else None,
                        "workers": workers,
                        "replicas": replicas,
                        "strategy": _strategy_name(strategy),
                        "keras": _keras_name(tf),
                        "samples_per_s": trained * steps * args.batch_size / wall,
                        "sha256": digest,
                        "restart": runtime.restart_count(),
                    },
                    f,
                )


def _report_callback(tf, args, steps, chief):  # type: ignore[no-untyped-def]
    """A Keras callback (its class needs TensorFlow, imported late): a progress bar and one line per epoch on the
    chief, every step's time, and the fault injection."""

    class Report(tf.keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):  # type: ignore[no-untyped-def]
            self.t0 = time.perf_counter()
            self.bar = Progress(steps, f"epoch {epoch + 1}/{args.epochs}", enabled=chief).__enter__()

        def on_train_batch_begin(self, batch, logs=None):  # type: ignore[no-untyped-def]
            self.t_step = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):  # type: ignore[no-untyped-def]
            self.step_ms.append(1000 * (time.perf_counter() - self.t_step))
            self.bar.update(loss=float((logs or {}).get("loss", 0.0)))

        def on_epoch_end(self, epoch, logs=None):  # type: ignore[no-untyped-def]
            self.bar.__exit__()
            logs = logs or {}
            if chief:
                print(
                    f"epoch {epoch + 1:2d}/{args.epochs}  train loss {logs.get('loss', 0):.4f}  test loss "
                    f"{logs.get('val_loss', 0):.4f}  test acc {logs.get('val_accuracy', 0):6.2%}  "
                    f"({time.perf_counter() - self.t0:.2f} s)",
                    flush=True,
                )
            config = runtime.tf_config()
            rank = config.rank if config else 0
            if args.fail_at_step == epoch + 1 and rank == args.fail_rank and runtime.restart_count() == 0:
                print(
                    f"paratrain demo --tf: fault injection: SIGKILL worker {rank} after epoch {epoch + 1}",
                    file=sys.stderr,
                    flush=True,
                )
                os.kill(os.getpid(), signal.SIGKILL)

    report = Report()
    report.step_ms = []
    return report


def _strategy_name(strategy) -> str:  # type: ignore[no-untyped-def]
    """The name users write: MultiWorkerMirroredStrategy's class is CollectiveAllReduceStrategy."""
    name = type(strategy).__name__
    return "MultiWorkerMirroredStrategy" if name == "CollectiveAllReduceStrategy" else name


def _keras_name(tf) -> str:  # type: ignore[no-untyped-def]
    return "tf-keras" if "tf_keras" in getattr(tf.keras, "__name__", "") else "Keras 3"


if __name__ == "__main__":
    main()
