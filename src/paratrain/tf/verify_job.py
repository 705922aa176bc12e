"""The worker side of ``paratrain verify --tf``: K steps of ``model.fit`` (SGD) at a fixed global batch, on the digits
CNN or on the user's ``module:function`` (it returns ``(model, x, y[, loss])`` and is called inside the strategy's
scope, after the seed), then every worker writes what the comparison and its diagnosis need.

Each worker records its initial weights' digest (different seeds show there), the sample indices it was handed
for each step (a second, identical pipeline run through ``strategy.experimental_distribute_dataset``: unsharded or
double-sharded data show there), the batch its dataset yields, and its final weights. ``--mistake`` makes one of
the usual mistakes on purpose, so the diagnosis is tested: ``seed`` (a seed per worker: harmless under
``MultiWorkerMirroredStrategy``, which copies worker 0's initial values to every worker), ``unsharded`` (auto-shard
OFF on data that is not split), ``unscaled`` (the dataset batched with the per-worker batch, not the global one).
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from . import runtime
from .demo_job import digits_arrays, digits_model, weights_digest

MISTAKES = ("none", "seed", "unsharded", "unscaled")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="paratrain.tf.verify_job")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32, help="global batch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mistake", choices=MISTAKES, default="none")
    p.add_argument("--factory", help="module:function returning (model, x, y[, loss]); default: the digits CNN")
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate")
    p.add_argument("--out", required=True, help="prefix of this worker's result file")
    args = p.parse_args(argv)

    strategy = runtime.strategy()
    tf = runtime.import_tf()
    config = runtime.tf_config()
    rank, workers = (config.rank, config.num_workers) if config else (0, 1)
    tf.keras.utils.set_random_seed(args.seed + (rank if args.mistake == "seed" else 0))
    with strategy.scope():  # the user's model is built where the strategy places its variables
        model, x, y, loss = _build(args.factory, tf)
        model.compile(optimizer=tf.keras.optimizers.SGD(args.lr), loss=loss)
    batch = args.batch_size // workers if args.mistake == "unscaled" else args.batch_size
    policy = "OFF" if args.mistake == "unsharded" else "DATA"

    def pipeline(*arrays):  # type: ignore[no-untyped-def]
        return runtime.auto_shard(tf.data.Dataset.from_tensor_slices(arrays).batch(batch).repeat(), policy)

    seen = []
    it = iter(strategy.experimental_distribute_dataset(pipeline(np.arange(len(x)))))
    for _ in range(args.steps):
        local = strategy.experimental_local_results(next(it))
        seen.append(sorted(int(i) for part in local for i in np.asarray(part[0]).ravel()))
    initial = weights_digest(model)
    model.fit(pipeline(x, y), epochs=1, steps_per_epoch=args.steps, verbose=0)
    np.savez(f"{args.out}.worker{rank}.npz", *model.get_weights())
    with open(f"{args.out}.worker{rank}.json", "w") as f:
        json.dump(
            {
                "rank": rank,
                "workers": workers,
                "initial": initial,
                "seen": seen,
                "batch": batch,
                "replicas": strategy.num_replicas_in_sync,
            },
            f,
        )


def _build(factory: str | None, tf):  # type: ignore[no-untyped-def]
    """``(model, x, y, loss)`` from the user's ``module:function``, or the digits CNN."""
    import importlib

    from ..errors import ConfigError

    default_loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if not factory:
        x, y, _, _ = digits_arrays(0)
        return digits_model(tf), x, y, default_loss
    module, _, name = factory.partition(":")
    built = getattr(importlib.import_module(module), name or "build")()
    if not isinstance(built, tuple) or len(built) not in (3, 4):
        raise ConfigError(f"{factory} must return (model, x, y) or (model, x, y, loss), got {type(built).__name__}")
    model, x, y, *loss = built
    return model, np.asarray(x), np.asarray(y), loss[0] if loss else default_loss


if __name__ == "__main__":
    main()
