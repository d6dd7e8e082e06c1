"""Epoch 1 of the guide's convnet with the remainder compiled in the background or in line.

    python scripts/compile_ahead.py background   # keras_dp's default
    python scripts/compile_ahead.py inline

One fresh process per run (JAX keeps compiled programs for the process; the
persistent compilation cache is off). 2 simulated CPU devices, 2,000 MNIST
rows, batch 64, steps_per_execution=4: three programs (4 steps of 64 rows,
1 of 64, 1 of 16), the first compiled before the epoch's first call, the
other two after it (`keras_dp.core.programs`). Prints epoch 1's wall and steps
seconds (`trainer.timings`). Interleave runs of both modes on a loaded
machine.
"""

import os
import sys

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=2"]).strip()
os.environ["KERAS_DP_COMPILATION_CACHE"] = "0"
os.environ.setdefault("KERAS_BACKEND", "jax")


def main(mode):
    import jax
    import keras

    import keras_dp
    from keras_dp.core import programs

    programs.CompilingFeed.background = mode == "background"
    (x, y), _ = keras_dp.datasets.load_mnist()
    keras.utils.set_random_seed(0)
    model = keras_dp.models.compile_classifier(keras_dp.models.convnet())
    trainer = keras_dp.ShardedTrainer(model, devices=jax.devices()[:2], steps_per_execution=4,
                                      data_on_device=False)
    trainer.fit(x[:2000, ..., None], y[:2000], batch_size=64, epochs=1, verbose=0)
    entry = trainer.timings[0]
    print(f"{mode}: epoch 1 wall {entry['wall_s']:.2f} s, steps {entry['steps_s']:.2f} s")


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("background", "inline"):
        sys.exit("usage: python scripts/compile_ahead.py background|inline")
    main(sys.argv[1])
