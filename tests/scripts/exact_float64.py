"""One epoch on N devices against Keras's `model.fit` on one, in float64.

Trains the guide's convnet (BatchNorm, Dropout 0.5) for one epoch of 1,000
rows at batch 64 (no batch divides by 3; the last has 40 rows) with
`model.fit` on one device and with `keras_dp.fit_sharded` on `--devices`,
and prints one JSON line per optimizer: both losses, the step counts and,
per variable path, the largest difference relative to the variable's largest
entry. A script, so that float64 and the device count are set before JAX and
Keras start.

Keras keeps some computations in float32 under floatx float64: on JAX,
`keras.backend.result_type` maps float64 to float32 (its
`BIT64_TO_BIT32_DTYPE` table), and BatchNormalization computes in
`result_type(inputs.dtype, "float32")`, as `keras.ops.mean` (so
GlobalAveragePooling2D) does. BatchNormalization's batch statistics are a
reduction over the batch: on N devices XLA sums each device's rows and
all-reduces the partial sums, a different float32 summation order from one
device's, so float32 rounding (1e-7) shows through a float64 comparison.
By default this script lets `result_type` keep float64, so that every
computation of both runs is float64; `--keras-float32-islands` leaves Keras
as it is, to show the difference that makes.
"""

import argparse
import json
import os

parser = argparse.ArgumentParser()
parser.add_argument("--devices", type=int, default=3)
parser.add_argument("--optimizers", default="sgd,adam")
parser.add_argument("--keras-float32-islands", action="store_true")
args = parser.parse_args()
# Other XLA flags stay (--xla_cpu_max_isa, to emulate another CPU); the last count wins.
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""),
                                    f"--xla_force_host_platform_device_count={args.devices}"])
os.environ["KERAS_BACKEND"] = "jax"
os.environ["JAX_ENABLE_X64"] = "1"

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dp  # noqa: E402
from keras_float64 import keep_keras_in_float64  # noqa: E402

if args.keras_float32_islands:
    keras.config.set_floatx("float64")
else:
    keep_keras_in_float64()

OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.01, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(1e-3),
}
NO_GRADIENT = "large_k/bias"  # see tests/test_equivalence.py


def convnet(optimizer):
    keras.utils.set_random_seed(7)
    model = keras_dp.models.convnet()
    model.compile(optimizer=OPTIMIZERS[optimizer](),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


(x, y), _ = keras_dp.datasets.load_mnist()
x, y = x[:1000, ..., None], y[:1000]
for optimizer in args.optimizers.split(","):
    reference, ours = convnet(optimizer), convnet(optimizer)
    theirs = reference.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0).history
    history = keras_dp.fit_sharded(ours, x, y, batch_size=64, epochs=1, shuffle=False,
                                   verbose=0, devices=jax.devices()[:args.devices]).history
    print(json.dumps({
        "optimizer": optimizer,
        "dtype": keras.config.floatx(),
        "keras_result_type": keras.backend.result_type("float64", "float32"),
        "devices": args.devices,
        "iterations": [int(reference.optimizer.iterations.numpy()),
                       int(ours.optimizer.iterations.numpy())],
        "keras_loss": theirs["loss"],
        "loss": history["loss"],
        "keras_accuracy": theirs["accuracy"],
        "accuracy": history["accuracy"],
        # Matched by position, named by the reference's paths (the second
        # model's automatic layer names carry a suffix).
        "relative_difference": {
            a.path: float(np.max(np.abs(np.asarray(a.value) - np.asarray(b.value)))
                          / np.max(np.abs(np.asarray(a.value))))
            for a, b in zip(reference.variables, ours.variables, strict=True)
            if a.path != NO_GRADIENT and np.issubdtype(np.asarray(a.value).dtype, np.floating)
            and np.max(np.abs(np.asarray(a.value))) > 0
        },
        "integer_variables_equal": all(
            np.array_equal(np.asarray(a.value), np.asarray(b.value))
            for a, b in zip(reference.variables, ours.variables, strict=True)
            if not np.issubdtype(np.asarray(a.value).dtype, np.floating)
        ),
        "dtypes": sorted({str(np.asarray(v.value).dtype) for v in ours.variables}),
    }))
