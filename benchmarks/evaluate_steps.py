"""`evaluate` and `predict` with `steps_per_execution` K: samples per second against K=1.

    python benchmarks/evaluate_steps.py --platform gpu            # issue 19: K=16 >= 2x K=1
    python benchmarks/evaluate_steps.py --devices 2 --samples 2048 --ks 1,4   # CPU

Evaluates (and predicts with) the guide's convnet, compiled as
`keras_dp.models.compile_classifier` does, on MNIST's test rows with
`ShardedTrainer(model, steps_per_execution=K).evaluate` / `.predict` for
each K, and, with `--systems ...,keras`, Keras's own `model.evaluate` under
`keras.distribution.DataParallel` with `compile(steps_per_execution=K)`
from the same weights. Each (system, K) first runs once untimed (it
compiles, the remainder batch's program too), then `--reps` timed calls
over all the rows, the systems' order reversed on alternate repetitions.
Every call returns host values (losses, or the predictions as numpy), so
each timer stops once the devices are done. The table gives the median
samples/s and its ratio to the same system at K=1; the JSON file holds the
raw seconds, the machine and the command. The losses of every K are
printed too: they must agree, evaluation being exact at any K.

Keras's `evaluate` is not in the CPU defaults: on XLA:CPU, dispatching
steps with a cross-device all-reduce without waiting can abort
(README "Simulated CPU devices"), and Keras's loop does not wait.
"""

import argparse
import json
import os
import pathlib
import shlex
import statistics
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--platform", choices=("cpu", "gpu", "tpu"), default="cpu")
    parser.add_argument("--devices", type=int, default=None,
                        help="simulated CPU devices (default 2), else the first N "
                             "of the platform's (default all)")
    parser.add_argument("--batch-sizes", default="64,256")
    parser.add_argument("--ks", default="1,4,16",
                        help="steps_per_execution values; 1 is always included")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--samples", type=int, default=None,
                        help="test rows (default: all 10,000)")
    parser.add_argument("--systems", default=None,
                        help="comma-separated subset of keras_dp_evaluate, "
                             "keras_dp_predict, keras (default: all on GPU/TPU, "
                             "the first two on CPU)")
    parser.add_argument("--data", default=None, help="mnist.npz or its directory")
    parser.add_argument("--out", default=None,
                        help="JSON file (default benchmarks/results-evaluate-<platform>.json)")
    args = parser.parse_args(argv)
    args.batch_sizes = [int(value) for value in args.batch_sizes.split(",")]
    args.ks = sorted({1, *(int(value) for value in args.ks.split(","))})
    if args.systems is None:
        args.systems = ("keras_dp_evaluate,keras_dp_predict" if args.platform == "cpu"
                        else "keras_dp_evaluate,keras_dp_predict,keras")
    args.systems = args.systems.split(",")
    unknown = set(args.systems) - {"keras_dp_evaluate", "keras_dp_predict", "keras"}
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}")
    if args.platform == "cpu" and args.devices is None:
        args.devices = 2
    if args.out is None:
        args.out = str(HERE / f"results-evaluate-{args.platform}.json")
    return args


def main(argv=None):
    args = parse_args(argv)
    load_average = os.getloadavg()
    sys.path.insert(0, str(HERE))
    import bench  # noqa: PLC0415  (sets the platform before JAX is imported)

    bench.set_platform(args.platform, args.devices)
    import jax  # noqa: PLC0415
    import keras  # noqa: PLC0415

    import keras_dp  # noqa: PLC0415

    devices = jax.devices()[: args.devices]
    x, y = bench.load_data(args.data, "test")
    x, y = x[: args.samples], y[: args.samples]
    print(f"{len(devices)} x {devices[0].device_kind}; {len(x)} test rows", flush=True)
    keras.utils.set_random_seed(0)
    weights = keras_dp.models.convnet().get_weights()
    runs = []
    for batch in args.batch_sizes:
        systems = [make_system(name, k, batch, devices, weights, x, y)
                   for name in args.systems for k in args.ks]
        for system in systems:  # compiles, the remainder batch's program too
            start = time.perf_counter()
            system["value"] = system["call"]()
            system["first_call_s"] = time.perf_counter() - start
            system["seconds"] = []
        for rep in range(args.reps):
            for system in systems if rep % 2 == 0 else systems[::-1]:
                start = time.perf_counter()
                system["call"]()
                system["seconds"].append(time.perf_counter() - start)
        for system in systems:
            runs.append({key: system[key] for key in ("system", "k", "batch", "first_call_s",
                                                      "seconds")}
                        | {"samples": len(x), "loss": system["loss"](system["value"])})
            print(f"{system['system']} batch={batch} K={system['k']}: loss "
                  f"{runs[-1]['loss']}, first call {system['first_call_s']:.1f} s", flush=True)
    rows = summarize(runs)
    print(markdown_table(rows))
    report = {
        "machine": bench.machine(len(devices), load_average),
        "command": shlex.join([sys.executable, *sys.argv]),
        "xla_flags": os.environ.get("XLA_FLAGS", ""), "args": vars(args),
        "runs": runs, "rows": rows,
    }
    pathlib.Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


def make_system(name, k, batch, devices, weights, x, y):
    """One system at one K: `{"system", "k", "batch", "call", "loss"}`.

    `call()` runs one evaluation (or prediction) over all of `x` and returns
    host values; `loss(value)` is the number printed to show that every K
    computed the same thing (the loss, or the predictions' mean).
    """
    import keras  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    import keras_dp  # noqa: PLC0415

    if name == "keras":
        distribution = keras.distribution.DataParallel(devices=devices)
        with distribution.scope():  # Keras lays the variables out as they are made
            model = keras_dp.models.convnet()
            model.compile(  # as compile_classifier, with Keras's K
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
                steps_per_execution=k)
            model.set_weights(weights)

        def call():
            with distribution.scope():
                return model.evaluate(x, y, batch_size=batch, verbose=0)

        return {"system": "keras DataParallel evaluate", "k": k, "batch": batch,
                "call": call, "loss": lambda value: float(value[0])}
    model = keras_dp.models.compile_classifier(keras_dp.models.convnet())
    model.set_weights(weights)
    trainer = keras_dp.ShardedTrainer(model, devices=devices, steps_per_execution=k)
    if name == "keras_dp_evaluate":
        return {"system": "keras_dp evaluate", "k": k, "batch": batch,
                "call": lambda: trainer.evaluate(x, y, batch_size=batch, verbose=0),
                "loss": lambda value: float(value[0])}
    return {"system": "keras_dp predict", "k": k, "batch": batch,
            "call": lambda: trainer.predict(x, batch_size=batch, verbose=0),
            "loss": lambda value: float(np.mean(value, dtype=np.float64))}


def summarize(runs):
    """Per run: samples/s median, min, max, and the median over the same system's at K=1."""
    rows = []
    for run in runs:
        rates = [run["samples"] / seconds for seconds in run["seconds"]]
        rows.append({key: run[key] for key in ("system", "batch", "k", "first_call_s", "loss")}
                    | {"median": statistics.median(rates), "min": min(rates),
                       "max": max(rates)})
    for row in rows:
        base = next(other["median"] for other in rows if other["system"] == row["system"]
                    and other["batch"] == row["batch"] and other["k"] == 1)
        row["vs_k1"] = row["median"] / base
    return rows


def markdown_table(rows):
    lines = ["| system | batch | K | median samples/s | min | max | vs K=1 | first call s | loss |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(
            f"| {row['system']} | {row['batch']} | {row['k']} | {row['median']:.0f} | "
            f"{row['min']:.0f} | {row['max']:.0f} | {row['vs_k1']:.2f} | "
            f"{row['first_call_s']:.1f} | {row['loss']:.6g} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
