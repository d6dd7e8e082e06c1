"""ResNet-18 on MNIST: seconds per epoch, images per second, share of peak FLOP/s.

    python benchmarks/resnet.py --platform gpu               # float32 and mixed_bfloat16
    python benchmarks/resnet.py --samples 512 --epochs 2 --policies float32   # CPU smoke run

For each dtype policy it trains `keras_dp.models.resnet18()` (d2l's variant:
3x3 stem, no max-pool, 4 stages of 2 residual blocks, 64-512 channels),
compiled as `keras_dp.models.compile_classifier` does, for `--epochs`
epochs at `--batch-size` on all devices of the platform, with keras_dp's
`ShardedTrainer.fit` and (unless `--systems keras_dp`) Keras's own
`model.fit` under `keras.distribution.DataParallel` from the same weights.
The first epoch compiles; the table gives the median of the later epochs'
seconds, the images per second that makes, the model FLOP/s (3 times the
forward pass's multiply-adds of every convolution and dense layer, counted
from the layer shapes) and that rate as a share of a matrix product's
measured FLOP/s in the policy's compute dtype on the same devices in the
same run (8192^3, default precision, so float32 may use TF32 where the
chip has it, as the model's convolutions do). Test accuracy after the last
epoch shows that the run trained.
"""

import argparse
import json
import os
import pathlib
import platform
import shlex
import statistics
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
SHARED_DATA = HERE.parents[1] / "shared" / "data"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--platform", choices=("cpu", "gpu", "tpu"), default="cpu")
    parser.add_argument("--policies", default="float32,mixed_bfloat16",
                        help="comma-separated Keras dtype policies")
    parser.add_argument("--systems", default="keras_dp,keras",
                        help="comma-separated subset of keras_dp, keras")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=4,
                        help="epochs per system; the first (compilation) is reported apart")
    parser.add_argument("--steps-per-execution", type=int, default=1)
    parser.add_argument("--samples", type=int, default=None,
                        help="training rows (default: all 60,000)")
    parser.add_argument("--matmul-size", type=int, default=8192)
    parser.add_argument("--data", default=None, help="mnist.npz or its directory")
    parser.add_argument("--out", default=None,
                        help="JSON file (default benchmarks/results-resnet18-<platform>.json)")
    args = parser.parse_args(argv)
    if args.epochs < 2:
        parser.error("--epochs must be at least 2: the first one compiles")
    args.policies = args.policies.split(",")
    args.systems = args.systems.split(",")
    if args.out is None:
        args.out = str(HERE / f"results-resnet18-{args.platform}.json")
    return args


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("KERAS_BACKEND", "jax")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # Compile times are part of what is measured: no persistent cache.
    os.environ["KERAS_DP_COMPILATION_CACHE"] = "0"
    os.environ["JAX_PLATFORMS"] = {"gpu": "cuda"}.get(args.platform, args.platform)
    import jax  # noqa: PLC0415  (after JAX_PLATFORMS is set)
    import keras  # noqa: PLC0415

    import keras_dp  # noqa: PLC0415

    path = args.data
    if path is None and "KERAS_DP_DATA_DIR" not in os.environ and SHARED_DATA.is_dir():
        path = SHARED_DATA
    (x, y), (x_test, y_test) = keras_dp.datasets.load_mnist(path)
    x, y = x[: args.samples, ..., None].astype("float32"), y[: args.samples]
    x_test = x_test[..., None].astype("float32")
    devices = jax.devices()
    flops_per_image = 3 * forward_flops(keras_dp.models.resnet18())
    print(f"{len(devices)} x {devices[0].device_kind}; {len(x)} images; "
          f"{flops_per_image / 1e9:.3f} GFLOP per training image", flush=True)
    rows, peaks = [], {}
    for policy in args.policies:
        dtype = keras.mixed_precision.Policy(policy).compute_dtype
        if dtype not in peaks:
            peaks[dtype] = matmul_flops(args.matmul_size, dtype, devices)
            print(f"matmul {args.matmul_size}^3 {dtype}: {peaks[dtype] / 1e12:.1f} TFLOP/s "
                  f"over {len(devices)} device(s)", flush=True)
        for system in args.systems:
            row = train(system, policy, args, devices, x, y, x_test, y_test)
            row["model_flops"] = row["images_per_s"] * flops_per_image
            row["share_of_matmul"] = row["model_flops"] / peaks[dtype]
            rows.append(row)
            print(one_line(row), flush=True)
    print(markdown_table(rows))
    report = {
        "machine": {"device_kind": devices[0].device_kind, "devices": len(devices),
                    "platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "python": platform.python_version(), "jax": jax.__version__,
                    "keras": keras.__version__, "keras_dp": keras_dp.__version__},
        "command": shlex.join([sys.executable, *sys.argv]),
        "xla_flags": os.environ.get("XLA_FLAGS", ""), "args": vars(args), "flops_per_training_image": flops_per_image,
        "matmul_flops_per_s": peaks, "rows": rows,
    }
    pathlib.Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


def forward_flops(model):
    """Multiply-adds x 2 of one image's forward pass through convolutions and dense layers.

    Batch normalization, activations, pooling and the residual additions
    are left out (a few percent), as model-FLOP counts usually do.
    """
    import keras  # noqa: PLC0415

    total = 0
    for layer in model.layers:
        if isinstance(layer, keras.layers.Conv2D):
            _, height, width, out_channels = layer.output.shape
            kernel_h, kernel_w, in_channels, _ = layer.kernel.shape
            total += 2 * height * width * out_channels * kernel_h * kernel_w * in_channels
        elif isinstance(layer, keras.layers.Dense):
            total += 2 * layer.kernel.shape[0] * layer.kernel.shape[1]
    return total


def matmul_flops(size, dtype, devices):
    """Measured FLOP/s of `size`^3 matrix products, one per device, run together."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    product = jax.jit(lambda a, b: a @ b)
    keys = jax.random.split(jax.random.key(0), 2 * len(devices))
    pairs = [
        tuple(jax.device_put(jax.random.normal(key, (size, size), dtype=jnp.float32)
                             .astype(dtype), device) for key in keys[2 * i: 2 * i + 2])
        for i, device in enumerate(devices)
    ]
    jax.block_until_ready([product(a, b) for a, b in pairs])  # compile and warm up
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(10):
            outs = [product(a, b) for a, b in pairs]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - start) / 10)
    return 2 * size**3 * len(devices) / statistics.median(times)


def train(system, policy, args, devices, x, y, x_test, y_test):
    """Train one system for `args.epochs`; return its timings and test accuracy."""
    import keras  # noqa: PLC0415

    import keras_dp  # noqa: PLC0415

    keras.mixed_precision.set_global_policy(policy)
    timer = epoch_timer()
    fit_kwargs = dict(batch_size=args.batch_size, epochs=args.epochs, shuffle=True,
                      verbose=0, callbacks=[timer])
    try:
        if system == "keras_dp":
            keras.utils.set_random_seed(0)
            model = keras_dp.models.compile_classifier(keras_dp.models.resnet18())
            trainer = keras_dp.ShardedTrainer(
                model, devices=devices, steps_per_execution=args.steps_per_execution)
            history = trainer.fit(x, y, **fit_kwargs)
            accuracy = trainer.evaluate(x_test, y_test, batch_size=args.batch_size,
                                        verbose=0)[1]
        elif system == "keras":
            keras.distribution.set_distribution(
                keras.distribution.DataParallel(devices=devices))
            keras.utils.set_random_seed(0)
            model = keras_dp.models.resnet18()
            model.compile(
                optimizer=keras.optimizers.Adam(1e-3),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
                steps_per_execution=args.steps_per_execution,
            )
            history = model.fit(x, y, **fit_kwargs)
            accuracy = model.evaluate(x_test, y_test, batch_size=args.batch_size,
                                      verbose=0)[1]
        else:
            raise ValueError(f"unknown system {system!r}; choose keras_dp or keras")
    finally:
        keras.distribution.set_distribution(None)
        keras.mixed_precision.set_global_policy("float32")
    later = timer.seconds[1:]
    epoch_s = statistics.median(later)
    return {"system": system, "policy": policy, "batch": args.batch_size,
            "k": args.steps_per_execution, "images": len(x), "epoch_seconds": timer.seconds,
            "first_epoch_s": timer.seconds[0], "epoch_s": epoch_s,
            "epoch_s_min": min(later), "epoch_s_max": max(later),
            "images_per_s": len(x) / epoch_s, "final_loss": history.history["loss"][-1],
            "test_accuracy": float(accuracy)}


def epoch_timer():
    """A Keras callback whose `seconds` lists each epoch's host-clock duration.

    Both trainers turn the epoch's logs into Python floats before
    `on_epoch_end`, so the devices are done when it is called.
    """
    import keras  # noqa: PLC0415

    class EpochTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seconds = []

        def on_epoch_begin(self, epoch, logs=None):
            self._start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds.append(time.perf_counter() - self._start)

    return EpochTimer()


def one_line(row):
    return (f"{row['system']} {row['policy']}: epochs {[round(s, 2) for s in row['epoch_seconds']]} s, "
            f"{row['images_per_s']:.0f} images/s, {row['model_flops'] / 1e12:.1f} TFLOP/s "
            f"({100 * row['share_of_matmul']:.0f}% of matmul), test accuracy "
            f"{row['test_accuracy']:.4f}")


def markdown_table(rows):
    lines = ["| system | policy | batch | s/epoch (median) | min | max | images/s | "
             "first epoch s | model TFLOP/s | share of matmul | test accuracy |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(
            f"| {row['system']} | {row['policy']} | {row['batch']} | {row['epoch_s']:.2f} | "
            f"{row['epoch_s_min']:.2f} | {row['epoch_s_max']:.2f} | {row['images_per_s']:.0f} | "
            f"{row['first_epoch_s']:.1f} | {row['model_flops'] / 1e12:.1f} | "
            f"{100 * row['share_of_matmul']:.0f}% | {row['test_accuracy']:.4f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
