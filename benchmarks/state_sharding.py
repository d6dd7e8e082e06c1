"""Step time and bytes per device of each `state_sharding` mode.

    python benchmarks/state_sharding.py --devices 4 --reps 20
    python benchmarks/state_sharding.py --devices 8 --reps 3 --batches 64
    python benchmarks/state_sharding.py --paper  # 1B parameters on 8 and 16 GPUs

For the guide's convnet and ResNet-18 (batch 64 and 256 images of 28x28, Adam),
each mode on the same simulated devices in one process: the median time of the
compiled train step over batches already on the devices (so the input
pipeline is not measured), and the state's bytes per device read from the
arrays' addressable shards. One JSON line per (model, mode).

`--paper` prints, without running anything, the bytes per device and the
collective volume per step (ring algorithms: an all-reduce moves
2 (N-1)/N of the data per device, a reduce-scatter or an all-gather
(N-1)/N) for a model of P float32 parameters trained with Adam.
"""

import argparse
import json
import os
import statistics
import time

parser = argparse.ArgumentParser()
parser.add_argument("--devices", type=int, default=4)
parser.add_argument("--reps", type=int, default=20)
parser.add_argument("--models", default="convnet,resnet18")
parser.add_argument("--batches", default="64,256", help="batch sizes, comma-separated")
parser.add_argument("--paper", action="store_true")
parser.add_argument("--parameters", type=float, default=1e9)
args = parser.parse_args()


def paper(parameters, devices):
    """Bytes per device and per-step collective bytes per device, fp32 + Adam."""
    weights, slots = 4 * parameters, 8 * parameters  # Adam: two float32 slots
    share = (devices - 1) / devices
    return {
        "devices": devices,
        "replicated": {"state_GB": (weights + slots) / 1e9,
                       "collectives_GB": 2 * share * weights / 1e9},  # gradient all-reduce
        "optimizer": {"state_GB": (weights + slots / devices) / 1e9,
                      # reduce-scatter of gradients + all-gather of new weights
                      "collectives_GB": 2 * share * weights / 1e9},
        "full": {"state_GB": (weights + slots) / devices / 1e9,
                 # weights gathered for forward and again for backward, grads scattered
                 "collectives_GB": 3 * share * weights / 1e9},
    }


if args.paper:
    for devices in (8, 16):
        print(json.dumps({"parameters": args.parameters, **paper(args.parameters, devices)}))
    raise SystemExit(0)

os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dp  # noqa: E402
from keras_dp import sharding  # noqa: E402


def time_step(trainer, batch, reps):
    state = trainer.init_state()
    device_batch = trainer.shard(batch)
    for _ in range(3):  # compile and warm up
        state, logs = trainer.train_step(state, device_batch)
    jax.block_until_ready(logs)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        state, logs = trainer.train_step(state, device_batch)
        jax.block_until_ready((state, logs))
        times.append(time.perf_counter() - start)
    return statistics.median(times), state


rng = np.random.default_rng(0)
for name in args.models.split(","):
    for batch_size in map(int, args.batches.split(",")):
        x = rng.integers(0, 255, (batch_size, 28, 28, 1)).astype("uint8")
        y = rng.integers(0, 10, batch_size)
        seconds = {}
        for mode in sharding.MODES:
            keras.utils.set_random_seed(0)
            model = keras_dp.models.compile_classifier(keras_dp.models.MODELS[name]())
            trainer = keras_dp.ShardedTrainer(model, devices=jax.devices()[:args.devices],
                                              state_sharding=mode)
            trainer.build((x, y))
            seconds[mode], state = time_step(trainer, (x, y), args.reps)
            print(json.dumps({
                "model": name, "batch": batch_size, "devices": args.devices,
                "state_sharding": mode, "step_ms": round(1000 * seconds[mode], 2),
                "ratio_to_replicated": round(seconds[mode] / seconds["replicated"], 3),
                "bytes_per_device": {group: sum(sharding.bytes_per_device(v) for v in values)
                                     for group, values in state.groups()},
                "platform": jax.devices()[0].platform,
            }), flush=True)
