"""The guide's one-machine program: Keras ``model.fit`` under ``tf.distribute.MirroredStrategy``.

MirroredStrategy copies the model onto every GPU of this machine (one process) and sums the gradients between
them each step; on a CPU-only machine it has one replica. Run it as is, or through paratrain::

    python examples/tf/mirrored_keras.py
    paratrain run --tf -n 1 examples/tf/mirrored_keras.py

The data: scikit-learn's bundled handwritten digits (1,797 8x8 images; nothing to download).
"""

import argparse

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=10)
args = parser.parse_args()

strategy = tf.distribute.MirroredStrategy()
print(f"replicas in sync: {strategy.num_replicas_in_sync}")

BATCH_PER_REPLICA = 64
GLOBAL_BATCH = BATCH_PER_REPLICA * strategy.num_replicas_in_sync

digits = load_digits()
x = (digits.images / 16.0).astype(np.float32)[..., None]
y = digits.target.astype(np.int64)
train = tf.data.Dataset.from_tensor_slices((x[:1400], y[:1400])).shuffle(1400, seed=0).batch(GLOBAL_BATCH)
test = tf.data.Dataset.from_tensor_slices((x[1400:], y[1400:])).batch(GLOBAL_BATCH)

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

model.fit(train, epochs=args.epochs, verbose=2)
loss, accuracy = model.evaluate(test, verbose=0)
print(f"test accuracy {accuracy:.4f}")
