"""The data and model of the multi-process tests, shared by the workers and the test.

Importing this module imports Keras; it starts no JAX backend.
"""

import keras
import numpy as np


def share_ids(rows, batch_size, index, count):
    """Process `index` of `count`'s row ids: its slice of every global batch, in order."""
    local = batch_size // count
    starts = range(0, rows, batch_size)
    return np.concatenate([np.arange(s + index * local, min(s + (index + 1) * local, rows))
                           for s in starts]).astype(np.int64)


def rows_of(ids, rows):
    """`(x, y)` of the given row ids: 8 seeded features, the label is the id."""
    x = np.random.default_rng(0).normal(size=(rows, 8)).astype(np.float32)
    return x[ids], ids.astype(np.float32)[:, None]


class IdHistogram(keras.metrics.Metric):
    """Counts how often each row id (the label) reaches the metric."""

    def __init__(self, rows, name="ids"):
        super().__init__(name=name)
        self.rows = rows
        self.counts = self.add_variable((rows,), initializer="zeros", name="counts")

    def update_state(self, y_true, y_pred, sample_weight=None):
        ids = keras.ops.cast(keras.ops.reshape(y_true, (-1,)), "int32")
        self.counts.assign_add(keras.ops.sum(keras.ops.one_hot(ids, self.rows), axis=0))

    def result(self):
        return keras.ops.convert_to_tensor(self.counts)


def make_model(rows):
    """A seeded two-layer regression onto id / rows, with Adam and the id histogram."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dense(1),
    ])

    def scaled_mse(y_true, y_pred):
        return keras.ops.mean(keras.ops.square(y_true / rows - y_pred), axis=-1)

    model.compile(optimizer=keras.optimizers.Adam(0.01), loss=scaled_mse,
                  metrics=[IdHistogram(rows)])
    return model
