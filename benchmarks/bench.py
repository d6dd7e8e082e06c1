"""Training throughput of keras_dp against Keras's own data parallelism, on MNIST.

One process per device count (JAX fixes the number of simulated CPU devices
when it starts):

    python benchmarks/bench.py --devices 2
    python benchmarks/bench.py --devices 1 --quick   # smoke run, about a minute (56 s on the 2-core VM, loaded)
    python benchmarks/bench.py --platform gpu        # every local GPU

For each batch size it builds every system (see `systems.py`), warms each up
with three calls of two executions each (the first, compilation included,
is reported as `first_call_s`), then times `--reps` repetitions of `--samples`
rows each, alternating the order of the systems between repetitions so that
slow drift of the machine affects them alike. It prints a markdown table of
samples/second (median, min, max, and the median relative to keras_dp's
best steps_per_execution at the same batch size) and writes every raw timing
to a JSON file.
"""

import argparse
import contextlib
import json
import math
import os
import pathlib
import platform
import shlex
import statistics
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
# Where this project's checkouts keep full MNIST (as tests/conftest.py does).
SHARED_DATA = HERE.parents[1] / "shared" / "data"
QUICK = {"batch_sizes": [32], "ks": [1, 2], "reps": 2, "samples": 128}
SYSTEM_KINDS = ("keras_dp", "keras", "guide", "bound", "scan")  # the default set
# keras_dp: scan (un)rolled, host-fed data, state donated (keep_last_good=False)
OPT_IN_KINDS = ("rolled", "unrolled", "host", "donate")
FULL = {"batch_sizes": [64, 256], "ks": [1, 4, 16], "reps": 3, "samples": 6400}


def parse_args(argv=None):
    """Parse the command line; `--quick` changes the defaults, not explicit flags."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--platform", choices=("cpu", "gpu", "tpu"), default="cpu",
                        help="JAX platform to run on (default cpu)")
    parser.add_argument("--devices", type=int, default=None,
                        help="number of devices: simulated CPU devices (sets XLA_FLAGS; "
                             "default 1), else the first N of the platform's (default all)")
    parser.add_argument("--batch-sizes", type=_int_list, default=None,
                        help="global batch sizes, comma-separated (default 64,256)")
    parser.add_argument("--ks", type=_int_list, default=None,
                        help="steps_per_execution values, comma-separated; 1 is "
                             "always included (default 1,4,16)")
    parser.add_argument("--reps", type=int, default=None,
                        help="timed repetitions per system (default 3)")
    parser.add_argument("--samples", type=int, default=None,
                        help="rows per timed repetition, rounded to whole calls "
                             "of the largest K (default 6400)")
    parser.add_argument("--systems", type=_system_list, default=None,
                        help="comma-separated subset of: keras_dp, keras, guide, bound, "
                             "scan (Keras's merged lax.scan, emulated) (the default), "
                             "rolled, unrolled (keras_dp's scan with unroll=1 or "
                             "unroll=K), host (keras_dp with data_on_device=False)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny smoke run: batch 32, K in 1,2, 2 reps of 128 rows")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", default=None,
                        help="mnist.npz or its directory (default: ../shared/data, "
                             "else keras_dp.datasets.load_mnist's search)")
    parser.add_argument("--out", default=None,
                        help="JSON file (default benchmarks/results-<devices>dev.json, "
                             "-quick.json with --quick)")
    args = parser.parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.ks = sorted(set(args.ks) | {1})
    if args.devices is None and args.platform == "cpu":
        args.devices = 1
    if args.out is None and args.devices is not None:
        args.out = default_out(args)
    return args


def default_out(args):
    """`benchmarks/results-[<platform>-]<devices>dev[-quick].json`."""
    suffix = "-quick" if args.quick else ""
    prefix = "" if args.platform == "cpu" else f"{args.platform}-"
    return str(HERE / f"results-{prefix}{args.devices}dev{suffix}.json")


def _int_list(text):
    values = [int(part) for part in text.split(",") if part]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _system_list(text):
    names = text.split(",")
    known = SYSTEM_KINDS + OPT_IN_KINDS
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown systems {unknown}; choose from {known}")
    return names


def set_platform(platform, count):
    """Choose JAX's platform (and `count` CPU devices); must run before JAX is imported."""
    if "jax" in sys.modules:
        raise RuntimeError(
            "JAX is already imported, so the device count can no longer be set. "
            "Run bench.py as its own process."
        )
    os.environ.setdefault("KERAS_BACKEND", "jax")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # Compile times are part of what is measured: no persistent cache.
    os.environ["KERAS_DP_COMPILATION_CACHE"] = "0"
    if platform != "cpu":
        os.environ["JAX_PLATFORMS"] = {"gpu": "cuda"}.get(platform, platform)
        return
    flags = [flag for flag in os.environ.get("XLA_FLAGS", "").split()
             if not flag.startswith("--xla_force_host_platform_device_count")]
    flags.append(f"--xla_force_host_platform_device_count={count}")
    os.environ["XLA_FLAGS"] = " ".join(flags)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main(argv=None):
    args = parse_args(argv)
    args.load_average = os.getloadavg()  # other work on the machine skews timings
    set_platform(args.platform, args.devices)
    sys.path.insert(0, str(HERE))
    import jax  # noqa: PLC0415  (only after XLA_FLAGS is set)

    if args.devices is None:
        args.devices = jax.device_count()
        args.out = args.out or default_out(args)
    devices = jax.devices()[: args.devices]
    if len(devices) != args.devices:
        raise RuntimeError(f"asked for {args.devices} devices, JAX has {jax.devices()}")
    x, y = load_data(args.data)
    started = time.time()
    runs, notes, counter = [], [], CompileCounter()
    for batch in args.batch_sizes:
        runs += bench_batch_size(args, batch, devices, x, y, notes, counter)
    report = make_report(args, runs, notes, time.time() - started)
    print(markdown_table(report["rows"]))
    for note in notes:
        print(f"note: {note}")
    pathlib.Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out} ({report['wall_s']:.0f} s)")


def load_data(path, split="train"):
    """MNIST's training (or `split="test"`) set as float32 `(n, 28, 28, 1)` images and uint8 labels."""
    import keras_dp  # noqa: PLC0415

    if path is None and "KERAS_DP_DATA_DIR" not in os.environ and SHARED_DATA.is_dir():
        path = SHARED_DATA
    train, test = keras_dp.datasets.load_mnist(path)
    x, y = train if split == "train" else test
    return x[..., None].astype("float32"), y


def bench_batch_size(args, batch, devices, x, y, notes, counter):
    """Warm up and time every system at one batch size; return their records."""
    unit = batch * math.lcm(*args.ks)
    samples = unit * max(1, round(args.samples / unit))
    if samples > len(x):
        raise ValueError(f"{samples} rows asked for, MNIST has {len(x)}; lower --samples")
    built = build_systems(args, batch, devices, notes)
    for system in built:
        system.record = {"system": system.name, "batch": batch, "k": system.k,
                         "samples": samples, **warm_up(system, x, y, counter),
                         "seconds": [], "compiles": []}
        system.prepare(x[:samples], y[:samples])
        print(f"warm: {system.name} batch={batch} K={system.k} "
              f"first call {system.record['first_call_s']:.1f} s", flush=True)
    for rep in range(args.reps):
        for system in built if rep % 2 == 0 else built[::-1]:
            with counter.count() as compiled:
                start = time.perf_counter()
                system.run(x[:samples], y[:samples])
                system.record["seconds"].append(time.perf_counter() - start)
            system.record["compiles"].append(compiled[0])
    for system in built:
        if any(system.record["compiles"]):
            notes.append(f"{system.name} batch={batch} K={system.k} compiled during timed "
                         f"calls: {system.record['compiles']}; its numbers include that")
    return [system.record for system in built]


def warm_up(system, x, y, counter, calls=3):
    """Calls on two calls' worth of K steps each, until the system is warm.

    The first call compiles. Later ones can compile again when a step gets
    state with other shardings than before: Keras under DataParallel on one
    device compiles its step for the fresh variables, for the state its
    steps return, and for the variables it synced back after a call. Three
    calls of two executions each see all of these.
    """
    rows = 2 * system.batch * system.k
    system.prepare(x[:rows], y[:rows])
    seconds, compiles = [], []
    for _ in range(calls):
        with counter.count() as compiled:
            start = time.perf_counter()
            system.run(x[:rows], y[:rows])
            seconds.append(time.perf_counter() - start)
        compiles.append(compiled[0])
    return {"first_call_s": seconds[0], "warm_up_s": seconds, "warm_up_compiles": compiles}


class CompileCounter:
    """Counts XLA compilations, to show that no timed call compiled."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        import jax  # noqa: PLC0415

        self._total = 0
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event, duration, **kwargs):
        del duration, kwargs
        if event == self.EVENT:
            self._total += 1

    @contextlib.contextmanager
    def count(self):
        """Yield a one-item list that holds, on exit, the compilations inside."""
        start, result = self._total, [0]
        try:
            yield result
        finally:
            result[0] = self._total - start


def build_systems(args, batch, devices, notes):
    """One system per (kind, K) asked for; those that cannot run become notes."""
    import keras_scan  # noqa: PLC0415
    import systems  # noqa: PLC0415

    wanted = args.systems or SYSTEM_KINDS
    kinds = {"keras_dp": (systems.KerasDP, args.ks), "keras": (systems.KerasDataParallel, args.ks),
             "guide": (systems.GuideLoop, [1]), "bound": (systems.ComputeBound, [1]),
             "rolled": (systems.KerasDPRolled, args.ks),
             "unrolled": (systems.KerasDPUnrolled, args.ks),
             "host": (systems.KerasDPHost, args.ks),
             "donate": (systems.KerasDPDonating, args.ks), "scan": (keras_scan.KerasScan, args.ks)}
    built = []
    for kind in wanted:
        cls, ks = kinds[kind]
        for k in ks:
            try:
                built.append(cls(batch, k, devices, args.seed))
            except systems.Unsupported as error:
                notes.append(f"{cls.name} batch={batch} K={k} skipped: {error}")
                print(f"note: {notes[-1]}", flush=True)
    return built


def make_report(args, runs, notes, wall_s):
    """Everything the JSON file holds: machine, command, raw and summary data."""
    return {
        "machine": machine(args.devices, args.load_average),
        "command": shlex.join([sys.executable, *sys.argv]),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "args": vars(args),
        "notes": notes,
        "wall_s": wall_s,
        "runs": runs,
        "rows": summarize(runs),
    }


def machine(devices, load_average):
    """The machine and versions a run's JSON records; `load_average` as at its start."""
    import jax  # noqa: PLC0415
    import keras  # noqa: PLC0415

    import keras_dp  # noqa: PLC0415

    return {
        "processor": platform.processor(), "cpu_model": _cpu_model(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(), "device_kind": jax.devices()[0].device_kind,
        "devices": devices, "python": platform.python_version(),
        "jax": jax.__version__, "keras": keras.__version__,
        "keras_dp": keras_dp.__version__, "load_average_at_start": load_average,
        "load_average_at_end": os.getloadavg(),
    }


def _cpu_model():
    """The CPU's model name from /proc/cpuinfo (platform.processor() is often empty)."""
    try:
        lines = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in lines
                 if line.startswith("model name")), None)


def summarize(runs):
    """Per run: samples/s median, min, max, and median / keras_dp's best median."""
    rows = []
    for run in runs:
        rates = [run["samples"] / seconds for seconds in run["seconds"]]
        rows.append({key: run[key] for key in ("system", "batch", "k", "first_call_s")}
                    | {"median": statistics.median(rates), "min": min(rates), "max": max(rates)})
    for row in rows:
        best = max((other["median"] for other in rows
                    if other["system"] == "keras_dp" and other["batch"] == row["batch"]),
                   default=None)
        row["vs_keras_dp_best"] = row["median"] / best if best else None
    return rows


def markdown_table(rows):
    """The summary as a markdown table, one line per (system, batch, K)."""
    lines = ["| system | batch | K | median samples/s | min | max | vs keras_dp best | first call s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        ratio = "n/a" if row["vs_keras_dp_best"] is None else f"{row['vs_keras_dp_best']:.2f}"
        lines.append(
            f"| {row['system']} | {row['batch']} | {row['k']} | {row['median']:.0f} | "
            f"{row['min']:.0f} | {row['max']:.0f} | {ratio} | {row['first_call_s']:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
