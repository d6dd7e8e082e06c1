"""One process of a multi-process test run (or the 1-process reference).

Started by tests/test_distributed.py, through `keras-dp launch` or directly,
with the KERAS_DP_* variables of `keras_dp.distributed.initialize`. Writes
what the test compares to `--out` (`process<i>.npz` or `reference.npz`).

Tasks:
    fit: SGD on this process's share of MNIST, one epoch, then the weights.
    reference: one process, all devices, on the global batches of `fit`
        ([process 0's local batch ++ process 1's] per step).
    uneven: a linear model on ids (labels are row ids) over shares of
        1,000 and 1,003 rows; a metric counts how often each id is seen.
    forever: train until killed, printing `training` once steps run.
"""

import argparse
import os
import sys

parser = argparse.ArgumentParser()
parser.add_argument("task", choices=["fit", "reference", "uneven", "forever"])
parser.add_argument("--out", required=True)
parser.add_argument("--rows", type=int, default=1024)
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--processes", type=int, default=2)
args = parser.parse_args()
os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dp  # noqa: E402
from keras_dp import distributed  # noqa: E402

if args.task != "reference":
    distributed.initialize()

import jax  # noqa: E402


def mlp():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Rescaling(1 / 255),
        keras.layers.Flatten(),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(10),
    ])
    model.compile(
        optimizer=keras.optimizers.SGD(0.05),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def mnist():
    (x, y), _ = keras_dp.datasets.load_mnist()
    return x[: args.rows, ..., None], y[: args.rows]


def share(array, index, count):
    n = len(array)
    return array[index * n // count:(index + 1) * n // count]


def save(name, model, **extra):
    np.savez(os.path.join(args.out, name),
             *[np.asarray(w) for w in model.get_weights()], **extra)


def fit():
    x, y = distributed.process_share(*mnist())
    model = mlp()
    history = keras_dp.fit_sharded(model, x, y, batch_size=args.batch_size, epochs=1,
                                   shuffle=False, verbose=1)
    save(f"process{jax.process_index()}.npz", model,
         loss=np.asarray(history.history["loss"]),
         iterations=int(model.optimizer.iterations.numpy()))


def reference():
    x, y = mnist()
    local = args.batch_size // args.processes
    shares = [(share(x, p, args.processes), share(y, p, args.processes))
              for p in range(args.processes)]
    steps = max(-(-len(sx) // local) for sx, _ in shares)
    batches = []
    for step in range(steps):
        rows = slice(step * local, (step + 1) * local)
        batches.append((np.concatenate([sx[rows] for sx, _ in shares]),
                        np.concatenate([sy[rows] for _, sy in shares])))
    model = mlp()
    history = keras_dp.fit_sharded(model, batches, epochs=1, verbose=0)
    save("reference.npz", model, loss=np.asarray(history.history["loss"]),
         iterations=int(model.optimizer.iterations.numpy()),
         devices=jax.device_count())


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


def uneven():
    rows = 2003
    ids = np.arange(rows, dtype=np.float32)
    mine = ids[:1000] if jax.process_index() == 0 else ids[1000:]
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(1e-7), loss="mse",
                  metrics=[IdHistogram(rows)])
    refused = []
    try:
        keras_dp.ShardedTrainer(model, steps_per_execution=2)
    except ValueError as error:
        refused.append("not supported across processes" in str(error))
    try:
        keras_dp.ShardedTrainer(model).fit(mine[:, None], mine, batch_size=21, verbose=0)
    except ValueError as error:
        refused.append("must divide" in str(error))
    trainer = keras_dp.ShardedTrainer(model)
    history = trainer.fit(mine[:, None] / rows, mine, batch_size=args.batch_size,
                          epochs=1, verbose=0)
    predictions = trainer.predict(mine[:, None] / rows, batch_size=args.batch_size,
                                  verbose=0)
    expected = model.predict(mine[:, None] / rows, verbose=0)
    save(f"process{jax.process_index()}.npz", model,
         counts=np.asarray(history.history["ids"][-1]),
         iterations=int(model.optimizer.iterations.numpy()),
         predictions=predictions, expected=expected, refused=np.asarray(refused))


def forever():
    x, y = distributed.process_share(*mnist())

    class Announce(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                print("training", flush=True)

    keras_dp.fit_sharded(mlp(), x, y, batch_size=args.batch_size, epochs=10_000,
                         verbose=0, callbacks=[Announce()])


if __name__ == "__main__":
    {"fit": fit, "reference": reference, "uneven": uneven, "forever": forever}[args.task]()
    print(f"done {args.task}", flush=True)
    sys.exit(0)
