"""The cost of one bare all-reduce: 2 processes x 1 device against 1 process x 2 devices.

`many_hosts.py` finds the 2-process gap in the all-reduces of the train
step. This measures them alone, with nothing else in the program: a jitted
sum over the `"batch"` axis of an array sharded over every device, whose
result is replicated, so its compiled program is one all-reduce. Each call
is waited for (`block_until_ready`) before the next, so a call's time is
one collective's latency plus dispatch, with no other process's compute to
wait for. Sizes: `--floats` per device (default 8, latency; and 200,000,
the 0.8 MB of the MLP's gradients).

    python benchmarks/collective_latency.py --reps 3

The driver starts `keras-dp launch --processes 2 --cpu-devices 1` and one
process with 2 simulated CPU devices; `--worker` is one run.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--floats", default="8,200000",
                    help="comma-separated float32 counts per device")
parser.add_argument("--calls", type=int, default=300)
parser.add_argument("--reps", type=int, default=3)
parser.add_argument("--worker", action="store_true")
args = parser.parse_args()


def worker():
    from keras_dp import distributed

    if distributed.requested_by_environment():
        distributed.initialize()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    import keras_dp

    mesh = keras_dp.make_mesh()
    rows = NamedSharding(mesh, PartitionSpec("batch"))
    replicated = NamedSharding(mesh, PartitionSpec())
    reduce = jax.jit(lambda a: jnp.sum(a, axis=0), out_shardings=replicated)
    result = {}
    for floats in map(int, args.floats.split(",")):
        local = np.ones((jax.local_device_count(), floats), np.float32)
        array = jax.make_array_from_process_local_data(rows, local)
        hlo = reduce.lower(array).compile().as_text()
        assert hlo.count("all-reduce(") + hlo.count("all-reduce-start(") >= 1, hlo
        reduce(array).block_until_ready()  # compile and warm up
        seconds = []
        for _ in range(args.calls):
            start = time.perf_counter()
            reduce(array).block_until_ready()
            seconds.append(time.perf_counter() - start)
        result[floats] = statistics.median(seconds) * 1e6
    if distributed.is_primary():
        print("RESULT " + json.dumps({"processes": jax.process_count(),
                                      "devices": jax.device_count(),
                                      "median_us": result}), flush=True)


def run(command, env):
    output = subprocess.run(command, env=env, capture_output=True, text=True, check=True,
                            timeout=600).stdout
    line = next(line for line in output.splitlines() if "RESULT " in line)
    return json.loads(line.split("RESULT ", 1)[1])["median_us"]


def driver():
    here = [sys.executable, os.path.abspath(__file__), "--worker",
            f"--floats={args.floats}", f"--calls={args.calls}"]
    launch = [sys.executable, "-m", "keras_dp", "launch", "--processes", "2",
              "--cpu-devices", "1", "--", *here]
    one = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    results = {"2 processes x 1 device": [], "1 process x 2 devices": []}
    for _ in range(args.reps):
        results["2 processes x 1 device"].append(run(launch, dict(os.environ)))
        results["1 process x 2 devices"].append(run(here, one))
    for floats in args.floats.split(","):
        medians = {name: statistics.median(run_[floats] for run_ in runs)
                   for name, runs in results.items()}
        two, one_ = medians["2 processes x 1 device"], medians["1 process x 2 devices"]
        print(f"{int(floats):,} floats per device: 2 processes {two:,.0f} us, "
              f"1 process {one_:,.0f} us per all-reduce call (medians of {args.reps} runs "
              f"of {args.calls} calls); {two / one_:.1f}x")
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    worker() if args.worker else driver()
