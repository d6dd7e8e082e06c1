"""A few steps of a `keras.applications` model on N devices against Keras on one.

Builds `--model` (32x32x3 input, `weights=None`, 10 classes) once, copies its
weights into a second copy, trains one with Keras's `model.fit` on one device
and the other with `keras_dp.fit_sharded` on `--devices`, on the same
`--steps` batches of 8 random images (`shuffle=False`), and prints one JSON
line: both runs' per-step losses and, per variable, the largest difference
relative to the variable's largest entry. Float64 by default, with Keras kept
in float64 throughout (see keras_float64.py); `--float32` runs Keras's default.
`--perturb` replaces keras_dp by a second Keras run from weights multiplied by
1 +- 1e-15 (float64) or 1e-7 (float32): how far rounding alone grows in the
same steps, the yardstick for keras_dp's difference.

Variables whose true value is zero hold rounding noise on any number of
devices, so their relative difference says nothing: a BatchNormalization
offset followed (through convolutions without bias and residual additions
only) by another BatchNormalization, which subtracts it again, has a true
gradient of 0; a moving mean over channels that are linear in such a
normalized output has a true batch mean of 0. In float64 the script lists
them apart (`zero_truth`: gradient below 1e-12 of the largest on the first
batch, or a moving statistic below 1e-12 in magnitude) and leaves them out of
`max_relative`.
"""

import argparse
import json
import os

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="EfficientNetV2B0")
parser.add_argument("--devices", type=int, default=2)
parser.add_argument("--steps", type=int, default=1)
parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
parser.add_argument("--float32", action="store_true")
parser.add_argument("--perturb", action="store_true")
parser.add_argument("--no-dropout", action="store_true",
                    help="set every Dropout's rate to 0 (stochastic depth included)")
args = parser.parse_args()
# Other XLA flags stay (--xla_cpu_max_isa, to emulate another CPU); the last count wins.
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""),
                                    f"--xla_force_host_platform_device_count={args.devices}"])
os.environ["KERAS_BACKEND"] = "jax"
if not args.float32:
    os.environ["JAX_ENABLE_X64"] = "1"

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dp  # noqa: E402
from keras_float64 import keep_keras_in_float64  # noqa: E402

if not args.float32:
    keep_keras_in_float64()
BATCH, SIZE = 8, 32


def build():
    keras.utils.set_random_seed(3)
    model = getattr(keras.applications, args.model)(
        input_shape=(SIZE, SIZE, 3), weights=None, classes=10)
    for layer in model.layers:
        if isinstance(layer, keras.layers.Dropout) and args.no_dropout:
            layer.rate = 0.0  # read when the step is traced
    optimizer = (keras.optimizers.SGD(0.01) if args.optimizer == "sgd"
                 else keras.optimizers.Adam(1e-3))
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    return model


class StepLosses(keras.callbacks.Callback):
    """Each step's loss: Keras logs the running mean, so step k is recovered from it."""

    def __init__(self):
        super().__init__()
        self.means = []

    def on_train_batch_end(self, batch, logs=None):
        self.means.append(float(logs["loss"]))

    def losses(self):
        return [m * (k + 1) - (self.means[k - 1] * k if k else 0.0)
                for k, m in enumerate(self.means)]


def zero_truth(model, x, y):
    """Paths of trainable variables whose first-batch gradient is 0 up to rounding."""
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    def loss(trainable):
        out, _ = model.stateless_call(trainable, non_trainable, x[:BATCH], training=True)
        return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(y[:BATCH], out))

    largest = {v.path: float(np.max(np.abs(g))) for v, g in
               zip(model.trainable_variables, jax.grad(loss)(trainable))}
    return {p for p, g in largest.items() if g < 1e-12 * max(largest.values())}


rng = np.random.default_rng(0)
x = rng.uniform(0, 255, (BATCH * args.steps, SIZE, SIZE, 3)).astype(keras.config.floatx())
y = rng.integers(0, 10, BATCH * args.steps)
reference, ours = build(), build()
weights = reference.get_weights()
zeros = set() if args.float32 else zero_truth(reference, x, y)
if args.perturb:
    noise = np.random.default_rng(1)
    size = 1e-7 if args.float32 else 1e-15
    weights = [w * (1 + size * noise.choice([-1.0, 1.0], w.shape)).astype(w.dtype)
               if np.issubdtype(w.dtype, np.floating) else w for w in weights]
ours.set_weights(weights)
theirs, mine = StepLosses(), StepLosses()
reference.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[theirs])
if args.perturb:
    ours.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[mine])
else:
    keras_dp.fit_sharded(ours, x, y, batch_size=BATCH, shuffle=False, verbose=0,
                         devices=jax.devices()[:args.devices], callbacks=[mine])

relative, zero_values = {}, {}
for a, b in zip(reference.variables, ours.variables, strict=True):
    expected, actual = np.asarray(a.value), np.asarray(b.value)
    scale = float(np.max(np.abs(expected)))
    if not np.issubdtype(expected.dtype, np.floating):
        relative[a.path] = 0.0 if np.array_equal(expected, actual) else float("inf")
    elif a.path in zeros or (not args.float32 and not a.trainable and scale < 1e-12):
        zero_values[a.path] = max(scale, float(np.max(np.abs(actual))))
    elif scale > 0:
        relative[a.path] = float(np.max(np.abs(actual - expected))) / scale
worst = max(relative, key=relative.get)
print(json.dumps({
    "model": args.model, "devices": args.devices, "optimizer": args.optimizer,
    "dtype": keras.config.floatx(), "perturb": args.perturb,
    "dropout_layers": sum(isinstance(layer, keras.layers.Dropout) and layer.rate > 0
                          for layer in ours.layers),
    "result_type": keras.backend.result_type("float64", "float32"),
    "keras_losses": theirs.losses(), "losses": mine.losses(),
    "first_loss_relative": abs(theirs.losses()[0] - mine.losses()[0]) / abs(theirs.losses()[0]),
    "max_relative": relative[worst], "worst": worst,
    "median_relative": float(np.median(list(relative.values()))),
    "compared": len(relative), "zero_truth": len(zero_values),
    "zero_truth_largest_entry": max(zero_values.values(), default=0.0),
}))
