"""Train the convnet on 1 device and on N devices from the same start.

Prints one JSON line per optimizer: the per-step losses of both runs and, per
variable path, the largest elementwise relative difference of the final
weights. A script, so that float64 (`--float64`) and the device count are set
before JAX and Keras start.
"""

import argparse
import json
import os

parser = argparse.ArgumentParser()
parser.add_argument("--float64", action="store_true")
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--devices", type=int, default=4)
parser.add_argument("--optimizers", default="adam,sgd")
parser.add_argument("--state-sharding", default="replicated",
                    help="the N-device runs' state_sharding modes, comma-separated "
                         "(the 1-device run is replicated)")
parser.add_argument("--model", default="convnet", choices=["convnet", "odd"])
parser.add_argument("--pairs", default=None,
                    help="optimizer:mode pairs, comma-separated, instead of every "
                         "optimizer with every --state-sharding mode")
args = parser.parse_args()
# Other XLA flags stay (--xla_cpu_max_isa, to emulate another CPU); the last count wins.
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""),
                                    f"--xla_force_host_platform_device_count={args.devices}"])
os.environ["KERAS_BACKEND"] = "jax"
if args.float64:
    os.environ["JAX_ENABLE_X64"] = "1"

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dp  # noqa: E402
from keras_float64 import keep_keras_in_float64  # noqa: E402

if args.float64:
    keep_keras_in_float64()

OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(1e-3),
    "sgd": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
}


def odd_model():
    """Layers whose sizes do not divide by 4 beside ones that do, Dropout, BatchNorm."""
    return keras.Sequential([
        keras.Input((28, 28, 1)), keras.layers.Rescaling(1 / 255.0),
        keras.layers.Conv2D(12, 3, activation="relu"), keras.layers.BatchNormalization(),
        keras.layers.Conv2D(10, 3, strides=2, activation="relu"), keras.layers.Flatten(),
        keras.layers.Dropout(0.25), keras.layers.Dense(30, activation="relu"),
        keras.layers.Dense(10),
    ])


def run(n_devices, batches, optimizer, state_sharding="replicated"):
    keras.utils.set_random_seed(1)
    model = keras_dp.models.convnet() if args.model == "convnet" else odd_model()
    model.compile(
        optimizer=OPTIMIZERS[optimizer](),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    trainer = keras_dp.ShardedTrainer(model, devices=jax.devices()[:n_devices],
                                      state_sharding=state_sharding)
    trainer.build(batches[0])
    state = trainer.init_state()
    losses = []
    for batch in batches:
        state, logs = trainer.train_step(state, trainer.shard(batch))
        losses.append(float(logs["loss"]))
    trainer.write_back(state)
    # Layer names differ between two instances (conv2d, conv2d_1, ...), so
    # variables are matched by position and named by the first run's paths.
    return losses, [(v.path, np.asarray(v.value)) for v in model.variables]


(x, y), _ = keras_dp.datasets.load_mnist()
x = x[..., None].astype(keras.config.floatx())
batches = [(x[i * 64:(i + 1) * 64], y[i * 64:(i + 1) * 64]) for i in range(args.steps)]
if args.pairs:
    pairs = [pair.split(":") for pair in args.pairs.split(",")]
else:
    pairs = [(optimizer, mode) for optimizer in args.optimizers.split(",")
             for mode in args.state_sharding.split(",")]
for optimizer in dict.fromkeys(optimizer for optimizer, _ in pairs):
    losses_1, weights_1 = run(1, batches, optimizer)
    for state_sharding in [mode for name, mode in pairs if name == optimizer]:
        losses_n, weights_n = run(args.devices, batches, optimizer, state_sharding)
        print(json.dumps({
            "optimizer": optimizer,
            "state_sharding": state_sharding,
            "dtype": keras.config.floatx(),
            "losses_1": losses_1,
            "losses_n": losses_n,
            "relative_difference": {
                path: float(np.max(np.abs(a - b)) / max(np.max(np.abs(a)), 1e-6))
                for (path, a), (_, b) in zip(weights_1, weights_n)
                if np.issubdtype(a.dtype, np.floating) and a.size
            },
        }))
