"""The guide's several-machine program: Keras ``model.fit`` under ``tf.distribute.MultiWorkerMirroredStrategy``.

The guide starts it once per machine after writing that machine's ``TF_CONFIG`` by hand::

    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": ["host1:12345", "host2:23456"]},
        "task": {"type": "worker", "index": 0},        # 1 on the second machine
    })

Those lines are gone: paratrain writes each worker's ``TF_CONFIG`` from its usual flags::

    paratrain run --tf -n 2 examples/tf/multi_worker_keras.py                       # two workers, this machine
    paratrain run --tf --nnodes 2 --node-rank R --master-addr HOST0 -n 1 examples/tf/multi_worker_keras.py

Keras 3's ``model.fit`` fails under this strategy (keras#20585): paratrain runs the workers with tf-keras
(``TF_USE_LEGACY_KERAS=1``), which the ``paratrain[tf]`` extra installs.
"""

import argparse
import json

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--out", help="worker 0 writes its test accuracy and replica count here (JSON)")
args = parser.parse_args()

strategy = tf.distribute.MultiWorkerMirroredStrategy()  # first: no TensorFlow op may run before it
print(f"replicas in sync: {strategy.num_replicas_in_sync}")

BATCH_PER_REPLICA = 32
GLOBAL_BATCH = BATCH_PER_REPLICA * strategy.num_replicas_in_sync

digits = load_digits()
x = (digits.images / 16.0).astype(np.float32)[..., None]
y = digits.target.astype(np.int64)
options = tf.data.Options()
options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
train = (
    tf.data.Dataset.from_tensor_slices((x[:1400], y[:1400]))
    .shuffle(1400, seed=0)
    .repeat()
    .batch(GLOBAL_BATCH)
    .with_options(options)
)
test = tf.data.Dataset.from_tensor_slices((x[1400:], y[1400:])).batch(GLOBAL_BATCH).with_options(options)

with strategy.scope():
    model = tf.keras.Sequential(
        [
            tf.keras.layers.Input(shape=(8, 8, 1)),
            tf.keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
            tf.keras.layers.MaxPooling2D(),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(64, activation="relu"),
            tf.keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer=tf.keras.optimizers.Adam(1e-3 * strategy.num_replicas_in_sync),
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )

model.fit(train, epochs=args.epochs, steps_per_epoch=1400 // GLOBAL_BATCH, verbose=2)
loss, accuracy = model.evaluate(test, verbose=0)
print(f"test accuracy {accuracy:.4f}")
task = json.loads(__import__("os").environ.get("TF_CONFIG", "{}")).get("task", {})
if args.out and task.get("index", 0) == 0:
    with open(args.out, "w") as f:
        json.dump(
            {
                "test_acc": accuracy,
                "replicas": strategy.num_replicas_in_sync,
                "keras": tf.keras.__name__ if hasattr(tf.keras, "__name__") else str(tf.keras),
            },
            f,
        )
