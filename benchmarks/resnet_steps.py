"""Where ResNet-18's training time goes: compiled steps alone, then whole epochs.

    python benchmarks/resnet_steps.py --platform gpu
    python benchmarks/resnet_steps.py --batches 4 --epoch-rows 512   # CPU smoke run

Part 1 times each compiled step over batches already on the device (one
dispatch per step, one wait at the end): keras_dp's `trainer.train_step`,
the same without its non-finite-loss guard, Keras's own
`jax.jit(model.train_step)` (what `model.fit` runs), and the guide's bare
`stateless_call` + `stateless_apply` step. Part 2 times one-epoch `fit`
calls from host arrays, alternating keras_dp variants (steps in flight,
prefetch, shuffle) with Keras's `model.fit`, after a warm-up epoch each.
"""

import argparse
import os
import statistics
import sys
import time


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--platform", choices=("cpu", "gpu", "tpu"), default="cpu")
    parser.add_argument("--policy", default="float32")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--batches", type=int, default=40, help="steps per part-1 timing")
    parser.add_argument("--epoch-rows", type=int, default=None,
                        help="rows per part-2 epoch (default all 60,000)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--data", default=None)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("KERAS_BACKEND", "jax")
    # Compile times are part of what is measured: no persistent cache.
    os.environ["KERAS_DP_COMPILATION_CACHE"] = "0"
    os.environ["JAX_PLATFORMS"] = {"gpu": "cuda"}.get(args.platform, args.platform)
    import jax
    import keras
    import numpy as np

    import keras_dp
    from keras_dp.core import steps as finite

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from systems import _guide_train_step

    keras.mixed_precision.set_global_policy(args.policy)
    (x, y), _ = keras_dp.datasets.load_mnist(args.data)
    x, y = x[: args.epoch_rows, ..., None].astype("float32"), y[: args.epoch_rows]
    batch = args.batch_size
    host = [(x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch])
            for i in range(args.batches)]

    def new_model():
        keras.utils.set_random_seed(0)
        return keras_dp.models.compile_classifier(keras_dp.models.resnet18())

    def time_steps(name, step, state, batches):
        state, _ = step(state, batches[0])  # compile
        jax.block_until_ready(state)
        rates = []
        for _ in range(args.reps):
            start = time.perf_counter()
            for b in batches:
                state, _ = step(state, b)
            jax.block_until_ready(state)
            rates.append((time.perf_counter() - start) / len(batches) * 1e3)
        print(f"step  {name:34s} {statistics.median(rates):7.2f} ms/step  "
              f"(min {min(rates):.2f}, max {max(rates):.2f})", flush=True)
        return state

    # Part 1: compiled steps on device-resident batches.
    trainer = keras_dp.ShardedTrainer(new_model())
    trainer.build(host[0])
    sharded = [trainer.shard(b) for b in host]
    time_steps("keras_dp train_step", trainer.train_step, trainer.init_state(), sharded)
    guard = finite.keep_if_not_finite
    finite.keep_if_not_finite = lambda new, old, logs, split=None: (new, logs)
    try:
        bare_dp = keras_dp.ShardedTrainer(new_model())
        bare_dp.build(host[0])
        time_steps("keras_dp without non-finite guard", bare_dp.train_step,
                   bare_dp.init_state(), sharded)
    finally:
        finite.keep_if_not_finite = guard

    model = new_model()
    model.build((None, 28, 28, 1))
    model._symbolic_build(data_batch=host[0])
    keras_state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in model.optimizer.variables],
        [v.value for v in model.metrics_variables],
    )
    keras_state = jax.tree.map(lambda a: jax.device_put(np.array(a)), keras_state)
    on_device = [jax.device_put(b) for b in host]
    keras_step = jax.jit(lambda state, data: model.train_step(state, data)[::-1],
                         donate_argnums=0)
    time_steps("keras jit(model.train_step)", keras_step, keras_state,
               [(bx, by) for bx, by in on_device])

    model = new_model()
    model.build((None, 28, 28, 1))
    optimizer = keras.optimizers.Adam(1e-3)
    optimizer.build(model.trainable_variables)
    guide_state = jax.tree.map(lambda a: jax.device_put(np.array(a)), (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in optimizer.variables]))
    guide = jax.jit(_guide_train_step(model, optimizer), donate_argnums=0)
    time_steps("guide stateless step", lambda s, b: guide(s, *b), guide_state, on_device)

    # Part 2: whole epochs from host arrays.
    variants = {
        "keras_dp fit (defaults)": dict(),
        "keras_dp fit steps_in_flight=8": dict(steps_in_flight=8),
        "keras_dp fit prefetch=0": dict(prefetch=0),
        "keras_dp fit shuffle=False": dict(shuffle=False),
    }
    dp = keras_dp.ShardedTrainer(new_model())
    keras_model = new_model()
    timings = {name: [] for name in [*variants, "keras model.fit"]}
    defaults = (dp.steps_in_flight, dp.hosts.prefetch)

    def run(name):
        start = time.perf_counter()
        if name == "keras model.fit":
            keras_model.fit(x, y, batch_size=batch, epochs=1, shuffle=True, verbose=0)
        else:
            options = dict(variants[name])
            shuffle = options.pop("shuffle", True)
            dp.steps_in_flight, dp.hosts.prefetch = defaults
            for key, value in options.items():
                setattr(dp.hosts if key == "prefetch" else dp, key, value)
            dp.fit(x, y, batch_size=batch, epochs=1, shuffle=shuffle, verbose=0)
        return time.perf_counter() - start

    for name in ("keras_dp fit (defaults)", "keras model.fit", "keras model.fit"):
        print(f"warm-up {name}: {run(name):.2f} s", flush=True)
    names = list(timings)
    for rep in range(args.reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            timings[name].append(run(name))
    for name, seconds in timings.items():
        print(f"epoch {name:34s} {statistics.median(seconds):7.3f} s  "
              f"(min {min(seconds):.3f}, max {max(seconds):.3f}; {len(x)} rows)", flush=True)


if __name__ == "__main__":
    main()
