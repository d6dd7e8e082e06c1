"""Epoch 1's validation with its programs compiled during the epoch, or at first use.

    python benchmarks/validation_ahead.py --batch-size 64 --runs 3
    python benchmarks/validation_ahead.py --batch-size 256 --runs 3

Fits the guide's convnet for one epoch on MNIST with `validation_data` the
10,000 test images, 2 simulated CPU devices, `steps_per_execution=4`,
in two modes, each run a fresh process (JAX keeps compiled programs for
the process; the persistent compilation cache is off), the modes
interleaved run by run:

- `ahead` (keras_dp's default): the validation's programs are compiled
  during epoch 1, after its first train call (`keras_dp.core.programs`);
- `first-use` (`EvalPrograms.ahead = False`, as before): each compiles
  when validation first calls it, at the end of epoch 1.

Prints, per run, epoch 1's `validation_s`, `steps_s` and `wall_s`
(`trainer.timings`), the seconds of one `trainer.evaluate` of the same
data right after (its programs compiled by then: the validation's floor),
the process's CPU seconds during `fit` (all threads: the work done, which
other jobs' load changes less than the wall time) and the load average,
then the medians per mode. `--out` appends each run
as a JSON line.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MODES = ("ahead", "first-use")


def measure(mode, batch_size, train_rows):
    """In this process: one epoch with validation; return the numbers as a dict."""
    os.environ["XLA_FLAGS"] = " ".join(
        [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=2"]).strip()
    os.environ["KERAS_DP_COMPILATION_CACHE"] = "0"
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import jax
    import keras

    import keras_dp
    from keras_dp.core import programs

    programs.EvalPrograms.ahead = mode == "ahead"
    (x, y), (x_val, y_val) = keras_dp.datasets.load_mnist()
    x, y = x[:train_rows, ..., None], y[:train_rows]
    keras.utils.set_random_seed(0)
    model = keras_dp.models.compile_classifier(keras_dp.models.convnet())
    trainer = keras_dp.ShardedTrainer(model, devices=jax.devices()[:2], steps_per_execution=4)
    cpu = time.process_time()
    trainer.fit(x, y, batch_size=batch_size, epochs=1, verbose=0,
                validation_data=(x_val[..., None], y_val))
    entry, cpu = trainer.timings[0], time.process_time() - cpu
    start = time.perf_counter()
    trainer.evaluate(x_val[..., None], y_val, batch_size=batch_size, verbose=0)
    return {"mode": mode, "batch_size": batch_size, "train_rows": len(x),
            "validation_s": entry["validation_s"], "steps_s": entry["steps_s"],
            "wall_s": entry["wall_s"], "evaluate_s": time.perf_counter() - start,
            "fit_cpu_s": cpu,
            "load_average": os.getloadavg()[0]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--train-rows", type=int, default=60000)
    parser.add_argument("--out", help="append each run's numbers here, a JSON line each")
    parser.add_argument("--measure", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.batch_size, args.train_rows)))
        return
    results = {mode: [] for mode in MODES}
    for run in range(args.runs):
        for mode in MODES if run % 2 == 0 else MODES[::-1]:
            output = subprocess.run(
                [sys.executable, __file__, "--measure", mode, "--batch-size",
                 str(args.batch_size), "--train-rows", str(args.train_rows)],
                check=True, capture_output=True, text=True).stdout
            numbers = json.loads(output.strip().splitlines()[-1])
            results[mode].append(numbers)
            print(json.dumps(numbers), flush=True)
            if args.out:
                with open(args.out, "a") as file:
                    file.write(json.dumps(numbers) + "\n")
    for mode, runs in results.items():
        medians = {key: statistics.median(run[key] for run in runs)
                   for key in ("validation_s", "steps_s", "wall_s", "evaluate_s", "fit_cpu_s")
                   if all(key in run for run in runs)}
        print(f"{mode:9s} batch {args.batch_size}: median of {len(runs)}: " + ", ".join(
            f"{key} {value:.2f}" for key, value in medians.items()))


if __name__ == "__main__":
    main()
