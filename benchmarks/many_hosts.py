"""Throughput of 2 processes x 1 device against 1 process x 2 devices, same run.

The guide's convnet on MNIST (`--samples` rows), global batch `--batch-size`,
`--steps-per-execution` K, the host feed in both (`data_on_device=False`, the
only feed across processes), one warm-up epoch then `--epochs` timed ones
(`trainer.timings`' samples per second, median). The two set-ups alternate
`--reps` times. Also prints the host round trips per epoch the processes
made to agree on their row counts (`trainer.hosts.exchange.rounds`), and the
all-reduces in one train step's compiled program: each is a collective
between the processes, and the convnet's exact BatchNorm statistics make
most of them (`--model mlp`, without BatchNorm, has only its gradients').

    python benchmarks/many_hosts.py --reps 2
    python benchmarks/many_hosts.py --reps 3 --xla-flags=--xla_cpu_multi_thread_eigen=false
    python benchmarks/many_hosts.py --reps 3 --batch-size 512
    python benchmarks/many_hosts.py --reps 3 --model mlp
    python benchmarks/many_hosts.py --reps 3 --profile

The driver starts the runs (`keras-dp launch --processes 2 --cpu-devices 1`
and one process with 2 simulated CPU devices); `--worker` is one run.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--samples", type=int, default=8192)
parser.add_argument("--batch-size", type=int, default=128)
parser.add_argument("--steps-per-execution", type=int, default=4)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--reps", type=int, default=2)
parser.add_argument("--model", default="convnet", choices=["convnet", "mlp"],
                    help="convnet: the guide's, with 3 BatchNorm layers; mlp: "
                         "Flatten-Dense(256)-Dense(10), no BatchNorm")
parser.add_argument("--xla-flags", default="",
                    help="extra XLA_FLAGS for both set-ups, e.g. "
                         "--xla_cpu_multi_thread_eigen=false (one thread per device)")
parser.add_argument("--profile", action="store_true",
                    help="trace the last epoch with jax.profiler in every run and "
                         "report process 0's seconds in all-reduces and in the rest "
                         "of the compiled steps")
parser.add_argument("--worker", action="store_true")
args = parser.parse_args()


def worker():
    import keras_dp
    from keras_dp import distributed
    from keras_dp.diagnostics import timing

    if distributed.requested_by_environment():
        distributed.initialize()
    import jax
    import numpy as np

    (x, y), _ = keras_dp.datasets.load_mnist()
    x, y = x[: args.samples, ..., None], y[: args.samples]
    if jax.process_count() > 1:
        x, y = distributed.process_share(x, y)
    import keras

    if args.model == "mlp":
        network = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Flatten(),
                                    keras.layers.Dense(256, activation="relu"),
                                    keras.layers.Dense(10, activation="softmax")])
    else:
        network = keras_dp.models.convnet()
    model = keras_dp.models.compile_classifier(network)
    trainer = keras_dp.ShardedTrainer(model, steps_per_execution=args.steps_per_execution,
                                      data_on_device=False)
    callbacks = [trace_epoch(args.epochs)] if args.profile else []
    trainer.fit(x, y, batch_size=args.batch_size, epochs=1 + args.epochs, verbose=0,
                callbacks=callbacks)
    rates = [entry["samples_per_s"] for entry in trainer.timings[1:]]
    rounds = getattr(getattr(trainer.hosts, "exchange", None), "rounds", 0)
    # The all-reduces in one step's program, each a collective between the
    # processes (through gloo over TCP across processes, in memory in one).
    rows = args.batch_size // jax.process_count()
    hlo = trainer.compiled_train_step(trainer.init_state(),
                                      trainer.shard((x[:rows], y[:rows]))).as_text()
    all_reduces = sum(line.count(" all-reduce(") + line.count(" all-reduce-start(")
                      for line in hlo.splitlines())
    if distributed.is_primary():
        # Samples counts global rows in every process, so the rate is global.
        print("RESULT " + json.dumps({
            "processes": jax.process_count(), "devices": jax.device_count(),
            "samples_per_s": float(np.median(rates)),
            "last_epoch": timing.describe(trainer.timings[-1]),
            "exchange_rounds_per_epoch": rounds / (1 + args.epochs),
            "steps_per_epoch": -(-args.samples // args.batch_size),
            "all_reduces_per_step": all_reduces,
            "profile": callbacks[0].summary() if callbacks else None,
        }), flush=True)


def trace_epoch(epoch):
    """A Keras callback tracing epoch `epoch` (0-based) with `jax.profiler`.

    Its `summary()` reads the trace back (its Perfetto JSON) and sums the
    compiled programs' operations by kind: the all-reduces (each waits for
    the other devices or processes to arrive, so it includes their skew)
    and everything else. Made in the worker, once Keras may be imported.
    """
    import tempfile

    import jax
    import keras

    class TraceEpoch(keras.callbacks.Callback):
        def on_epoch_begin(self, index, logs=None):
            if index == epoch:
                self.directory = tempfile.mkdtemp(prefix="many_hosts_trace_")
                jax.profiler.start_trace(self.directory, create_perfetto_trace=True)

        def on_epoch_end(self, index, logs=None):
            if index == epoch:
                jax.profiler.stop_trace()

        def summary(self):
            return summarise_trace(self.directory)

    return TraceEpoch()


def summarise_trace(directory):
    """Seconds and counts of the trace's all-reduce and other XLA operations."""
    import glob
    import gzip
    import re

    path = glob.glob(f"{directory}/plugins/profile/*/perfetto_trace.json.gz")[0]
    trace = json.load(gzip.open(path))
    totals = {"all_reduce_s": 0.0, "all_reduces": 0, "other_ops_s": 0.0}
    for event in trace["traceEvents"]:
        name = event.get("name", "")
        # XLA's operations are named for the HLO instruction (`all-reduce.118`,
        # `ynn_fusion.84`); Python frames start with "$", runtime spans are
        # "ThunkExecutor::Execute", "PjitFunction(...)" and the like.
        if (event.get("ph") != "X" or name.startswith("$")
                or not re.fullmatch(r"[a-z][\w-]*\.?\d*", name)):
            continue
        if name.startswith("all-reduce"):
            totals["all_reduce_s"] += event["dur"] / 1e6
            totals["all_reduces"] += 1
        else:
            totals["other_ops_s"] += event["dur"] / 1e6
    import jax

    # Summed over this process's devices: per device, as each runs the step.
    return {key: value / jax.local_device_count() for key, value in totals.items()}


def run(command, env):
    output = subprocess.run(command, env=env, capture_output=True, text=True, check=True,
                            timeout=1200).stdout
    line = next(line for line in output.splitlines() if "RESULT " in line)
    return json.loads(line.split("RESULT ", 1)[1])


def driver():
    here = [sys.executable, os.path.abspath(__file__), "--worker",
            *[f"--{name.replace('_', '-')}={value}" for name, value in vars(args).items()
              if name not in ("worker", "reps", "xla_flags", "profile")],
            *(["--profile"] if args.profile else [])]
    launch = [sys.executable, "-m", "keras_dp", "launch", "--processes", "2",
              "--cpu-devices", "1", "--", *here]
    extra = dict(os.environ, XLA_FLAGS=args.xla_flags) if args.xla_flags else dict(os.environ)
    one = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{args.xla_flags} --xla_force_host_platform_device_count=2".strip())
    results = {"2 processes x 1 device": [], "1 process x 2 devices": []}
    for _ in range(args.reps):
        results["2 processes x 1 device"].append(run(launch, extra))
        results["1 process x 2 devices"].append(run(here, one))
    for name, runs in results.items():
        rates = [result["samples_per_s"] for result in runs]
        print(f"{name}: {statistics.median(rates):,.0f} samples/s (runs: "
              f"{', '.join(f'{rate:,.0f}' for rate in rates)}); host round trips per "
              f"epoch of {runs[0]['steps_per_epoch']} steps: "
              f"{runs[0]['exchange_rounds_per_epoch']:g}; all-reduces per step: "
              f"{runs[0]['all_reduces_per_step']}\n  last run's last epoch: "
              f"{runs[-1]['last_epoch']}")
        if runs[-1]["profile"]:
            profile = runs[-1]["profile"]
            print(f"  last run's last epoch, process 0's trace, per device: "
                  f"{profile['all_reduces']:.0f} all-reduces, {profile['all_reduce_s']:.2f} s "
                  f"in them (with the wait for the other device to arrive), "
                  f"{profile['other_ops_s']:.2f} s in the other compiled operations "
                  f"(tracing slows the traced epoch: take rates from runs without --profile)")
    ratio = (statistics.median(r["samples_per_s"] for r in results["2 processes x 1 device"])
             / statistics.median(r["samples_per_s"] for r in results["1 process x 2 devices"]))
    print(f"ratio: {ratio:.2f}x; load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    worker() if args.worker else driver()
