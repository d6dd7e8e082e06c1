"""Micro-batches against whole batches and Keras's `model.fit` on one device, in float64.

Trains a Dense + LayerNormalization model for 2 epochs of 230 rows at batch
50 (the last batch 30 rows; none divides by 3 devices, nor 50 by 4
micro-batches) with `model.fit` on one device, and with
`keras_dp.fit_sharded` on 3 devices with `micro_batches=1` and `4`, at
`steps_per_execution` 1 and 4, and on a 2 x 2 ("batch", "model") mesh
under Keras's `ModelParallel` with `micro_batches=4`; prints one JSON line: for each run, per
variable path, the largest difference from Keras's relative to the
variable's largest entry, and the histories. A script, so that float64 and
the device count are set before JAX and Keras start.
"""

import json
import os

os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""),
                                    "--xla_force_host_platform_device_count=4"])
os.environ["KERAS_BACKEND"] = "jax"
os.environ["JAX_ENABLE_X64"] = "1"

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dp  # noqa: E402
from keras_float64 import keep_keras_in_float64  # noqa: E402

keep_keras_in_float64()


def model():
    keras.utils.set_random_seed(3)
    net = keras.Sequential([keras.Input((12,)), keras.layers.Dense(32, activation="tanh", name="hidden"),
                            keras.layers.LayerNormalization(), keras.layers.Dense(4, name="head")])
    net.compile(optimizer=keras.optimizers.Adam(1e-2),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"])
    return net


def differences(reference, other):
    return {variable.path: float(np.max(np.abs(np.asarray(variable) - np.asarray(theirs)))
                                 / max(np.max(np.abs(np.asarray(theirs))), 1e-300))
            for variable, theirs in zip(other.weights, reference.weights, strict=True)}


def report(ours, history):
    return {"max_relative": max(differences(keras_model, ours).values()),
            "loss": history.history["loss"], "accuracy": history.history["accuracy"],
            "iterations": int(ours.optimizer.iterations.numpy())}


rng = np.random.default_rng(0)
x, y = rng.normal(size=(230, 12)), rng.integers(0, 4, 230)
keras_model = model()
keras_history = keras_model.fit(x, y, batch_size=50, epochs=2, shuffle=False, verbose=0).history
runs = {}
for micro in (1, 4):
    for k in (1, 4):
        ours = model()
        history = keras_dp.fit_sharded(ours, x, y, batch_size=50, epochs=2, shuffle=False,
                                       verbose=0, micro_batches=micro, steps_per_execution=k,
                                       devices=jax.devices()[:3])
        runs[f"micro_batches={micro}, K={k}"] = report(ours, history)
mesh = keras.distribution.DeviceMesh((2, 2), ("batch", "model"), jax.devices())
layout_map = keras.distribution.LayoutMap(mesh)
layout_map[".*hidden/kernel"] = (None, "model")
layout_map[".*head/kernel"] = ("model", None)
distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
with distribution.scope():  # the weights created split, as Keras lays them out
    ours = model()
history = keras_dp.fit_sharded(ours, x, y, batch_size=50, epochs=2, shuffle=False, verbose=0,
                               micro_batches=4, distribution=distribution)
runs["ModelParallel 2x2, micro_batches=4"] = report(ours, history)
runs["ModelParallel 2x2, micro_batches=4"]["kernel_spec"] = str(
    ours.get_layer("hidden").kernel.value.sharding.spec)
print(json.dumps({"dtype": keras.config.floatx(), "keras_loss": keras_history["loss"],
                  "keras_iterations": int(keras_model.optimizer.iterations.numpy()),
                  "runs": runs}))
