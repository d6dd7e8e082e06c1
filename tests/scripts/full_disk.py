"""Checkpoints on a real, small filesystem (a tmpfs); run inside `unshare -rm`.

`directory` must be an empty mount point. This mounts a tmpfs of `--mib`
MiB there and fits a small model with `checkpoint_dir` on it:
`--case small` expects the up-front refusal (no step taken), `--case fill`
fills the disk at the end of epoch 1 (after the check passed) and expects
the save's one clear error, with the model holding the epoch's weights.
Prints one JSON line with what happened.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys

parser = argparse.ArgumentParser()
parser.add_argument("directory")
parser.add_argument("--mib", type=float, required=True)
parser.add_argument("--case", choices=["small", "fill"], required=True)
args = parser.parse_args()
subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(args.mib * 1024)}k", "tmpfs",
                args.directory], check=True)
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["KERAS_BACKEND"] = "jax"
os.environ["KERAS_DP_COMPILATION_CACHE"] = "0"
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dp  # noqa: E402


class FillDisk(keras.callbacks.Callback):
    """Fills the checkpoint filesystem at the end of the first epoch, before its save."""

    def on_epoch_end(self, epoch, logs=None):
        with open(os.path.join(args.directory, "filler"), "wb", buffering=0) as file:
            try:
                while True:
                    file.write(b"\0" * 65536)
            except OSError:
                pass


def model():
    keras.utils.set_random_seed(0)
    made = keras.Sequential([keras.Input((16,)), keras.layers.Dense(256, activation="relu"),
                             keras.layers.Dense(10)])
    made.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return made


rng = np.random.default_rng(0)
x = rng.normal(size=(256, 16)).astype("float32")
y = rng.integers(0, 10, 256)
fit = dict(batch_size=32, epochs=1, verbose=0, devices=jax.devices()[:2])
reference = model()
if args.case == "fill":
    keras_dp.fit_sharded(reference, x, y, **fit)  # one epoch, no checkpoint
trained = model()
try:
    keras_dp.fit_sharded(trained, x, y, checkpoint_dir=args.directory,
                         callbacks=[FillDisk()] if args.case == "fill" else [], **fit)
    error = None
except OSError as raised:
    error = f"{type(raised).__name__}: {raised}"
equal = all(np.array_equal(a, b) for a, b in zip(trained.get_weights(), reference.get_weights()))
print(json.dumps({"error": error, "weights_equal_reference": equal,
                  "steps": int(trained.optimizer.iterations.numpy()),
                  "files": sorted(os.listdir(args.directory))}), flush=True)
