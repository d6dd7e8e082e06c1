"""Seconds for `python -m keras_dp --help`, against the same after importing Keras and JAX.

    python benchmarks/cli_startup.py            # README "The command line"
    python benchmarks/cli_startup.py --runs 3

`keras-dp --help` and argument errors import neither Keras nor JAX. Each run
is a fresh Python process, timed from its start to its exit: `--help` as
typed, and `--help` after `import jax, keras` (what the command paid when it
imported them before parsing its arguments), alternating. Prints the median
and range of each, their ratio, and the machine.
"""

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

HELP = [sys.executable, "-m", "keras_dp", "--help"]
IMPORTS_FIRST = [sys.executable, "-c",
                 "import sys, runpy, jax, keras; sys.argv = ['keras-dp', '--help']; "
                 "runpy.run_module('keras_dp', run_name='__main__')"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="fresh processes of each kind")
    return parser.parse_args(argv)


def seconds(command):
    """Wall seconds of one fresh process, which must print the usage."""
    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="2")
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
    elapsed = time.perf_counter() - start
    if "usage" not in result.stdout:
        raise RuntimeError(f"{command} printed no usage:\n{result.stdout}{result.stderr}")
    return elapsed


def main(argv=None):
    args = parse_args(argv)
    load_average = os.getloadavg()
    times = {"help": [], "imports_first": []}
    for run in range(args.runs):
        order = [("help", HELP), ("imports_first", IMPORTS_FIRST)]
        for name, command in order if run % 2 == 0 else order[::-1]:
            times[name].append(seconds(command))
    for name, label in (("help", "python -m keras_dp --help"),
                        ("imports_first", "the same after import jax, keras")):
        values = times[name]
        print(f"{label}: median {statistics.median(values):.2f} s "
              f"(range {min(values):.2f}-{max(values):.2f} s, {args.runs} runs)")
    ratio = statistics.median(times["imports_first"]) / statistics.median(times["help"])
    print(f"ratio: {ratio:.1f}x")
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}; load average {load_average[0]:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end")


def cpu_model():
    """The CPU's model name (benchmarks/bench.py's reading, without importing JAX here)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench  # noqa: PLC0415  (imports no JAX at module level)

    return bench._cpu_model()


if __name__ == "__main__":
    main()
