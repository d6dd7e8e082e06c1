"""What each trainer compiles in its first epoch, and how long that takes.

    python benchmarks/first_epoch.py --model resnet18
    python benchmarks/first_epoch.py --model resnet18 --platform gpu

Trains one epoch of 80 random 28x28 images at batch 32 (two full steps and
a 16-row remainder) with keras_dp's `ShardedTrainer.fit` and with Keras's
`model.fit`, each in a fresh process with JAX's persistent cache off, on one
device, and prints the epoch's wall seconds, the seconds XLA spent
compiling (summed from `jax_log_compiles`), how many programs were compiled
and the slowest few. This is how the non-finite guard's compile cost was
found (`benchmarks/guard_compile.py`).
"""

import argparse
import logging
import os
import re
import subprocess
import sys
import time

COMPILED = re.compile(r"Finished XLA compilation of (.*?) in ([0-9.e-]+) s")


def measure(system, model_name):
    """Run in this process: one epoch of `system`; print one line and the slowest compiles."""
    os.environ["KERAS_DP_COMPILATION_CACHE"] = "0"
    import jax

    jax.config.update("jax_log_compiles", True)
    compiles = []

    class Recorder(logging.Handler):
        def emit(self, record):
            match = COMPILED.search(record.getMessage())
            if match:
                compiles.append((float(match.group(2)), match.group(1)))

    logging.getLogger("jax").addHandler(Recorder())
    logging.getLogger("jax").setLevel(logging.DEBUG)
    import keras
    import numpy as np

    import keras_dp

    rng = np.random.default_rng(0)
    x = rng.integers(0, 255, (80, 28, 28, 1)).astype("uint8")
    y = rng.integers(0, 10, 80)
    keras.utils.set_random_seed(0)
    model = keras_dp.models.compile_classifier(keras_dp.models.MODELS[model_name]())
    compiles.clear()
    start = time.perf_counter()
    if system == "keras_dp":
        keras_dp.ShardedTrainer(model, devices=jax.devices()[:1]).fit(
            x, y, batch_size=32, epochs=1, verbose=0)
    else:
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    wall = time.perf_counter() - start
    compiles.sort(reverse=True)
    print(f"{system:9s} {model_name}: first epoch {wall:5.1f} s, compiling "
          f"{sum(s for s, _ in compiles):5.1f} s in {len(compiles)} programs; slowest: "
          + ", ".join(f"{name} {s:.1f} s" for s, name in compiles[:3]), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--platform", default="cpu")
    parser.add_argument("--system", help=argparse.SUPPRESS)  # the child's part
    args = parser.parse_args()
    os.environ.setdefault("KERAS_BACKEND", "jax")
    os.environ["JAX_PLATFORMS"] = {"gpu": "cuda"}.get(args.platform, args.platform)
    if args.system:
        return measure(args.system, args.model)
    for system in ("keras_dp", "keras"):
        subprocess.run([sys.executable, __file__, "--model", args.model,
                        "--platform", args.platform, "--system", system], check=True,
                       stderr=subprocess.DEVNULL)


if __name__ == "__main__":
    main()
