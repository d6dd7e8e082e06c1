"""What the train step's non-finite guard costs to compile, in memory and per step.

    python benchmarks/guard_compile.py --model resnet18
    python benchmarks/guard_compile.py --model convnet

`keras_dp.core.steps.keep_if_not_finite` checks that every new weight and
optimizer value is finite. Checked with one reduction per variable, that
check made ResNet-18's train step compile about 3x slower on XLA:CPU; the
trainer now checks the replicated values of each dtype as one joined vector
(`join=True`). For one device and batch 32, this compiles the same step
three ways, in one process, and prints per variant the compile seconds,
the compiled program's temporary bytes (`memory_analysis()`) and the median
of 5 steps:

- `joined`: the trainer's default for a replicated state;
- `per variable`: one reduction per variable (the trainer's check before);
- `none`: no guard at all, the floor.
"""

import argparse
import os
import statistics
import time

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="resnet18")
parser.add_argument("--batch-size", type=int, default=32)
args = parser.parse_args()
os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ["KERAS_DP_COMPILATION_CACHE"] = "0"  # compile times are what is measured

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dp  # noqa: E402
from keras_dp.core import steps as finite  # noqa: E402

guard = finite.keep_if_not_finite
VARIANTS = {
    "joined": guard,
    "per variable": lambda new, old, logs, split=None: per_variable(new, old, logs),
    "none": lambda new, old, logs, split=None: (new, logs),
}


def per_variable(new, old, logs):
    """The guard with one reduction per variable instead of the joined one."""
    joined = finite._all_finite
    finite._all_finite = lambda values: jax.numpy.all(jax.numpy.stack(
        [jax.numpy.all(jax.numpy.isfinite(v)) for v in jax.tree.leaves(values)
         if jax.numpy.issubdtype(v.dtype, jax.numpy.floating)] or [jax.numpy.asarray(True)]))
    try:
        return guard(new, old, logs)
    finally:
        finite._all_finite = joined


rng = np.random.default_rng(0)
batch = (rng.integers(0, 255, (args.batch_size, 28, 28, 1)).astype("uint8"),
         rng.integers(0, 10, args.batch_size))
print(f"{args.model}, batch {args.batch_size}, 1 {jax.devices()[0].platform} device, "
      f"jax {jax.__version__}")
for name, variant in VARIANTS.items():
    finite.keep_if_not_finite = variant  # read when the step is traced
    keras.utils.set_random_seed(0)
    model = keras_dp.models.compile_classifier(keras_dp.models.MODELS[args.model]())
    trainer = keras_dp.ShardedTrainer(model, devices=jax.devices()[:1])
    trainer.build(batch)
    state, device_batch = trainer.init_state(), trainer.shard(batch)
    lowered = trainer.programs.train_step.lower(state, device_batch)
    start = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(6):  # the first call is left out
        start = time.perf_counter()
        state, _ = compiled(state, device_batch)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - start)
    print(f"{name:13s} compile {compile_s:6.1f} s  temp "
          f"{compiled.memory_analysis().temp_size_in_bytes / 1e6:7.1f} MB  "
          f"step {1000 * statistics.median(times[1:]):7.1f} ms", flush=True)
finite.keep_if_not_finite = guard
