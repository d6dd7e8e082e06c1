"""Disk taken by `checkpoint_dir` after a fit: the checkpoints kept and their bytes.

    python benchmarks/checkpoint_size.py                 # README "How many are kept"
    python benchmarks/checkpoint_size.py --epochs 3 --keep 1

Trains the tests' 25,450-parameter MLP (784 -> 32 -> 10, Adam, as
`keras_dp.models.compile_classifier` compiles it) on `--rows` MNIST rows for
`--epochs` epochs with `checkpoint_dir` and `checkpoints_to_keep=--keep`,
then prints the training state's bytes (weights, optimizer slots, metric
totals), which checkpoints the directory holds, and its size as `du -sb`
counts it (every file's and directory's apparent size), with the machine.
"""

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--keep", type=int, default=2,
                        help="checkpoints_to_keep (default 2, keras_dp's default)")
    parser.add_argument("--rows", type=int, default=256, help="MNIST training rows")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--devices", type=int, default=1, help="simulated CPU devices")
    parser.add_argument("--data", default=None, help="mnist.npz or its directory")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    load_average = os.getloadavg()
    sys.path.insert(0, str(HERE))
    import bench  # noqa: PLC0415  (sets the platform before JAX is imported)

    bench.set_platform("cpu", args.devices)
    import jax  # noqa: PLC0415
    import keras  # noqa: PLC0415

    import keras_dp  # noqa: PLC0415

    x, y = bench.load_data(args.data)
    x, y = x[: args.rows], y[: args.rows]
    keras.utils.set_random_seed(0)
    model = keras_dp.models.compile_classifier(keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Rescaling(1 / 255),
        keras.layers.Flatten(),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(10),
    ]))
    with tempfile.TemporaryDirectory() as directory:
        checkpoints = pathlib.Path(directory) / "ckpt"
        keras_dp.fit_sharded(model, x, y, batch_size=args.batch_size, epochs=args.epochs,
                             verbose=0, checkpoint_dir=checkpoints,
                             checkpoints_to_keep=args.keep)
        kept = sorted((path.name for path in checkpoints.iterdir() if path.name.isdigit()),
                      key=int)
        size = disk_bytes(checkpoints)
    variables = (model.trainable_variables + model.non_trainable_variables
                 + model.optimizer.variables + model.metrics_variables)
    state = sum(int(variable.numpy().nbytes) for variable in variables)
    print(f"model: {model.count_params():,} parameters; training state "
          f"{state:,} bytes ({state / 1000:.0f} KB: weights, Adam slots, metric totals)")
    print(f"after {args.epochs} epochs (checkpoints_to_keep={args.keep}): checkpoints "
          f"{' '.join(kept)}; directory {size:,} bytes ({size / 1000:.0f} KB, du -sb)")
    machine = bench.machine(len(jax.devices()), load_average)
    print(f"machine: {machine['cpu_model']}, {machine['cpu_count']} cores, "
          f"{len(jax.devices())} simulated device(s); keras {machine['keras']}, "
          f"jax {machine['jax']}; load average {load_average[0]:.1f}")


def disk_bytes(path):
    """`du -sb path`: apparent bytes of every file and directory (Python's sum without du)."""
    try:
        output = subprocess.run(["du", "-sb", str(path)], check=True, capture_output=True,
                                text=True).stdout
        return int(output.split()[0])
    except (OSError, subprocess.CalledProcessError):
        return sum(entry.stat().st_size for entry in [path, *path.rglob("*")])


if __name__ == "__main__":
    main()
