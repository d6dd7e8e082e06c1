"""Train with `checkpoint_dir` and send this process SIGTERM after a random step.

keras_dp saves a checkpoint at the next step boundary and exits with status
143; the caller checks the status and the message (and, over many runs,
that the exit is never an abort). `--host` feeds batches from the host
(with the look-ahead thread), else the data stays on the devices.
"""

import argparse
import os
import pathlib
import random
import signal
import sys

parser = argparse.ArgumentParser()
parser.add_argument("directory")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--host", action="store_true")
args = parser.parse_args()
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["KERAS_BACKEND"] = "jax"
os.environ["KERAS_DP_COMPILATION_CACHE"] = "0"
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dp  # noqa: E402


class SigtermAfter(keras.callbacks.Callback):
    """Sends the process SIGTERM at the end of train step `at` (counted over the run)."""

    def __init__(self, at):
        super().__init__()
        self.at, self.steps = at, 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        if self.steps == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


rng = np.random.default_rng(0)
x = rng.normal(size=(256, 16)).astype("float32")
y = rng.integers(0, 10, 256)
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dense(10)])
model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
keras_dp.fit_sharded(
    model, x, y, batch_size=32, epochs=4, verbose=0, devices=jax.devices()[:2],
    checkpoint_dir=args.directory, data_on_device=not args.host,
    callbacks=[SigtermAfter(random.Random(args.seed).randint(1, 30))])
print("finished without SIGTERM", flush=True)
