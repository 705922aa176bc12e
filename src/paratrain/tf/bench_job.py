"""The worker side of ``paratrain bench --tf``: the digits CNN under ``model.fit`` on generated images, timed.

One untimed epoch of ``--warmup`` steps (graph tracing, the first collectives), then ``--rounds`` epochs of
``--steps`` steps, each round timed whole by a Keras callback (its end waits for the round's last step; a step's
own callback may fire while TensorFlow still runs it). Worker 0 writes the seconds per step of every round.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from . import runtime
from .demo_job import digits_model


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="paratrain.tf.bench_job")
    p.add_argument("--batch", type=int, required=True, help="global batch")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="intra-op threads per worker (0: TensorFlow's choice)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    tf = runtime.import_tf()
    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    strategy = runtime.strategy()
    tf.keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.random((args.batch * 8, 8, 8, 1), dtype=np.float32)
    y = rng.integers(0, 10, args.batch * 8)
    data = runtime.auto_shard(tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch).repeat().prefetch(2))
    with strategy.scope():
        model = digits_model(tf)
        model.compile(
            optimizer=tf.keras.optimizers.SGD(0.01),
            loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    model.fit(data, epochs=1, steps_per_epoch=args.warmup, verbose=0)
    timer = _timer_class(tf)()
    model.fit(data, epochs=args.rounds, steps_per_epoch=args.steps, verbose=0, callbacks=[timer])
    if runtime.is_chief():
        with open(args.out, "w") as f:
            json.dump(
                {
                    "world": runtime.num_workers(),
                    "replicas": strategy.num_replicas_in_sync,
                    "global_batch": args.batch,
                    "rounds": timer.rounds,
                },
                f,
            )


def _timer_class(tf):  # type: ignore[no-untyped-def]
    """The timing callback's class (it needs TensorFlow, imported late)."""

    class Timer(tf.keras.callbacks.Callback):
        """Per round (epoch): its wall time over its steps."""

        def __init__(self) -> None:
            super().__init__()
            self.rounds: list[float] = []

        def on_epoch_begin(self, epoch, logs=None):  # type: ignore[no-untyped-def]
            self.t0 = time.perf_counter()
            self.steps = 0

        def on_train_batch_end(self, batch, logs=None):  # type: ignore[no-untyped-def]
            self.steps += 1

        def on_epoch_end(self, epoch, logs=None):  # type: ignore[no-untyped-def]
            float((logs or {}).get("loss", 0.0))  # the round's last step has finished
            self.rounds.append((time.perf_counter() - self.t0) / max(self.steps, 1))

    return Timer


if __name__ == "__main__":
    main()
