"""Train the custom-step models with Keras's fit on 1 device and keras_dp on N.

Prints one JSON line per model: the per-epoch logs of both and the largest
difference of any variable, relative to that variable's largest value. A
script, so that float64 (`--float64`) and the device count are set before
JAX and Keras start.
"""

import argparse
import json
import os
import pathlib
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--float64", action="store_true")
parser.add_argument("--devices", type=int, default=3)
parser.add_argument("--models", default="dcgan,vae,add_loss_model")
parser.add_argument("--rows", type=int, default=155)
parser.add_argument("--batch-size", type=int, default=50)
args = parser.parse_args()
# Other XLA flags stay (--xla_cpu_max_isa, to emulate another CPU); the last count wins.
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""),
                                    f"--xla_force_host_platform_device_count={args.devices}"])
os.environ["KERAS_BACKEND"] = "jax"
if args.float64:
    os.environ["JAX_ENABLE_X64"] = "1"
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dp  # noqa: E402
from keras_float64 import keep_keras_in_float64  # noqa: E402
import parity_models  # noqa: E402

if args.float64:
    keep_keras_in_float64()

images, labels = parity_models.mnist_like(args.rows)
images = images.astype(keras.config.floatx())
for name in args.models.split(","):
    build = getattr(parity_models, name)
    x = {"image": images, "label": labels} if name == "add_loss_model" else images
    options = dict(batch_size=args.batch_size, epochs=2, shuffle=False, verbose=0)
    reference = build(0)
    expected = reference.fit(x, **options).history
    ours = build(0)
    got = keras_dp.fit_sharded(ours, x, devices=jax.devices()[:args.devices], **options).history
    difference = 0.0
    for a, b in zip(reference.variables, ours.variables, strict=True):
        a, b = np.asarray(a.value, np.float64), np.asarray(b.value, np.float64)
        if a.size:
            difference = max(difference, float(np.max(np.abs(a - b)) / max(np.max(np.abs(a)), 1e-12)))
    print(json.dumps({"model": name, "dtype": keras.config.floatx(), "keras": expected,
                      "keras_dp": got, "relative_difference": difference}), flush=True)
