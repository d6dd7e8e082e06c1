"""Time to the first step, with and without a warm persistent compilation cache.

Each run is a fresh Python process that imports keras_dp, builds the convnet
and calls `fit_sharded` on MNIST-shaped data with a callback that stops
training after the first step. The time measured runs from just before the
process is started to the end of that first step (interpreter start,
imports, building, tracing, compiling or loading from the cache, the step):
what a user waits for when rerunning a script. Cold runs get a new, empty
cache directory each; warm runs share one that a first run filled.

    python benchmarks/compile_cache.py --devices 2 --runs 3
    python benchmarks/compile_cache.py --devices 2 --runs 3 --cli

With `--cli` each run is the main job itself, `keras-dp train` (on
`--data-dir`, else where the command finds MNIST), stopped at the end of its
first training step; its cache directory is given through
`KERAS_DP_COMPILATION_CACHE`.

Prints one JSON line per run and a summary with the medians and their ratio,
and the median split of each kind of run into importing, building the model,
and `fit_sharded` up to the end of the first step.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import sys, time
import numpy as np
import keras_dp
import keras
print("MARK imported", time.time(), flush=True)

cache, batch_size, early = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "early"
if early:  # as `keras-dp train` does: before the model's initializers compile
    keras_dp.diagnostics.compilation_cache.enable(cache, min_compile_time_s=0)
rng = np.random.default_rng(0)
x = rng.random((4 * batch_size, 28, 28, 1), dtype=np.float32)
y = rng.integers(0, 10, 4 * batch_size)
model = keras_dp.models.compile_classifier(keras_dp.models.convnet())
print("MARK built", time.time(), flush=True)


class FirstStep(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        float(logs["loss"])  # the step has finished
        print("MARK first_step_end", time.time(), flush=True)
        self.model.stop_training = True


keras_dp.fit_sharded(model, x, y, batch_size=batch_size, epochs=1, verbose=0,
                     callbacks=[FirstStep()], compilation_cache=cache,
                     data_on_device=False)
"""


# `keras-dp train`, its first step marked by a callback added to the
# trainer's `fit`; the process ends there (os._exit: nothing after it is timed).
CLI_CHILD = r"""
import json, logging, os, sys, time
import keras
import keras_dp
import keras_dp.cli
print("MARK imported", time.time(), flush=True)

# The programs JAX loaded from the persistent cache (hits) or compiled (misses).
messages = []
handler = logging.Handler()
handler.emit = lambda record: messages.append(record.getMessage())
logging.getLogger("jax._src.compiler").setLevel(logging.DEBUG)
logging.getLogger("jax._src.compiler").addHandler(handler)


class FirstStep(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        float(logs["loss"])  # the step has finished
        print("MARK first_step_end", time.time(), flush=True)
        named = lambda start: [m.split("'")[1] for m in messages if m.startswith(start)]
        print("PROGRAMS", json.dumps({"hits": named("Persistent compilation cache hit"),
                                      "misses": named("PERSISTENT COMPILATION CACHE MISS")}),
              flush=True)
        os._exit(0)


fit = keras_dp.ShardedTrainer.fit


def fit_to_first_step(self, *args, callbacks=None, **kwargs):
    return fit(self, *args, callbacks=list(callbacks or []) + [FirstStep()], **kwargs)


keras_dp.ShardedTrainer.fit = fit_to_first_step
keras_dp.cli.main(sys.argv[1:])
"""

PHASES = ("imports", "build", "to_first_step_end")
CLI_PHASES = ("imports", "to_first_step_end")  # what each stretch of a run ends with


def run_once(cache_dir, devices, batch_size, early, cli=None):
    """Seconds from starting a process to the end of its first step, and its split.

    Returns `(total, {"imports": s, "build": s, "to_first_step_end": s})`:
    interpreter start and importing keras_dp, Keras and JAX; building and
    compiling the model (its initializers run here); then `fit_sharded` up
    to the end of the first step (tracing, compiling or loading, the step).
    With `cli` (the `keras-dp train` arguments after the batch size), the
    run is that command and the split is `{"imports": s,
    "to_first_step_end": s, "compiled": n, "loaded": n}`, the last two
    the programs compiled, and loaded from the persistent cache, up to the
    end of the first step.
    """
    env = {key: value for key, value in os.environ.items()  # the cache is the run's own
           if key not in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")}
    env.update(KERAS_BACKEND="jax",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    if cli is not None:
        env["KERAS_DP_COMPILATION_CACHE"] = cache_dir
        command = [sys.executable, "-c", CLI_CHILD, "train", "--cpu-devices", str(devices),
                   "--batch-size", str(batch_size), "--verbose", "0", *cli]
    else:
        command = [sys.executable, "-c", CHILD, cache_dir, str(batch_size),
                   "early" if early else "trainer"]
    start = time.time()
    with tempfile.TemporaryDirectory() as cwd:  # the CLI's output directory
        result = subprocess.run(command, capture_output=True, text=True, env=env,
                                timeout=600, cwd=cwd)
    if result.returncode != 0:
        raise RuntimeError(f"the timed process failed:\n{result.stderr[-3000:]}")
    marks = dict(line.split()[1:] for line in result.stdout.splitlines()
                 if line.startswith("MARK "))
    names = ("imported", "first_step_end") if cli is not None else (
        "imported", "built", "first_step_end")
    times = [start] + [float(marks[name]) for name in names]
    split = {phase: later - earlier for phase, earlier, later
             in zip(CLI_PHASES if cli is not None else PHASES, times, times[1:])}
    if cli is not None:
        programs = json.loads(next(line for line in result.stdout.splitlines()
                                   if line.startswith("PROGRAMS "))[len("PROGRAMS "):])
        split.update(compiled=len(programs["misses"]), loaded=len(programs["hits"]))
    return times[-1] - start, split


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--cli", action="store_true",
                        help="time `keras-dp train` itself instead of a script")
    parser.add_argument("--data-dir", help="with --cli: passed to keras-dp train")
    args = parser.parse_args()
    if args.cli:
        cli = ["--data-dir", os.path.abspath(args.data_dir)] if args.data_dir else []
        summarise("keras-dp train", args, *measure(args, True, cli),
                  CLI_PHASES + ("compiled", "loaded"))
        return
    for early in (False, True):
        summarise("before building the model" if early else "by the trainer", args,
                  *measure(args, early), PHASES)


def measure(args, early, cli=None):
    """`(cache_entries, {"cold": [s], "warm": [s]}, {"cold": [split], "warm": [split]})`
    for one way of enabling the cache, `split` as `run_once` returns it."""
    times = {"cold": [], "warm": []}
    phases = {"cold": [], "warm": []}
    with tempfile.TemporaryDirectory() as root:
        warm_dir = os.path.join(root, "warm")
        run_once(warm_dir, args.devices, args.batch_size, early, cli)  # fills the warm cache
        entries = len(os.listdir(warm_dir))
        for index in range(args.runs):  # interleaved, so load drifts hit both
            cold_dir = os.path.join(root, f"cold{index}")
            for kind, path in (("cold", cold_dir), ("warm", warm_dir)):
                seconds, split = run_once(path, args.devices, args.batch_size, early, cli)
                times[kind].append(seconds)
                phases[kind].append(split)
                enabled = "keras-dp train" if cli is not None else (
                    "early" if early else "by the trainer")
                print(json.dumps({"enabled": enabled,
                                  "kind": kind, "run": index, "seconds": round(seconds, 3),
                                  **{phase: round(s, 3) for phase, s in split.items()}}),
                      flush=True)
    return entries, times, phases


def summarise(enabled, args, entries, times, phases, names):
    cold, warm = (statistics.median(times[kind]) for kind in ("cold", "warm"))
    split = {f"{kind}_{phase}_median" + ("" if phase in ("compiled", "loaded") else "_s"):
             round(statistics.median(
                 run[phase] for run in phases[kind]), 3)
             for kind in ("cold", "warm") for phase in names}
    print(json.dumps({
        "enabled": enabled,
        "devices": args.devices, "batch_size": args.batch_size, "runs": args.runs,
        "cache_entries": entries, "cold_median_s": round(cold, 3),
        "warm_median_s": round(warm, 3), "cold_over_warm": round(cold / warm, 2),
        **split,
    }), flush=True)

if __name__ == "__main__":
    main()
