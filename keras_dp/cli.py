"""The `keras-dp` command: parse arguments, set up devices, call the library.

    keras-dp train --epochs 2 --cpu-devices 2 --data-dir ../shared/data

trains the guide's convnet on MNIST over all local devices, prints what ran
where and how fast, then the test accuracy, and saves the model (`.keras`)
and its training curves (PNG).
"""

import argparse
import builtins
import os
import pathlib
import time

# Importing Keras (and through it JAX) starts no backend, so --cpu-devices can
# still take effect after this.
import keras


def build_parser():
    """Return the argument parser of `keras-dp`."""
    parser = argparse.ArgumentParser(
        prog="keras-dp",
        description="Synchronous data-parallel training of Keras models on JAX devices.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = commands.add_parser(
        "train", help="train a model on MNIST over all local devices",
        description="Train a model on MNIST with data parallelism over all local devices.",
    )
    train.add_argument("--model", default="convnet", choices=["convnet", "resnet18"],
                       help="the model to train (default: %(default)s)")
    train.add_argument("--epochs", type=int, default=2, help="default: %(default)s")
    train.add_argument("--batch-size", type=int, default=64,
                       help="global batch, split over the devices (default: %(default)s)")
    train.add_argument("--learning-rate", type=float, default=1e-3,
                       help="Adam's learning rate (default: %(default)s)")
    train.add_argument("--data-dir", default=None,
                       help="a directory with mnist.npz (default: $KERAS_DP_DATA_DIR, "
                            "Keras's cache, a download, then the bundled subset)")
    train.add_argument("--train-samples", type=int, default=None,
                       help="train on the first N images only (default: all)")
    train.add_argument("--cpu-devices", type=int, default=None, metavar="N",
                       help="run on N simulated CPU devices (sets XLA_FLAGS and "
                            "JAX_PLATFORMS=cpu before JAX starts)")
    train.add_argument("--output-dir", default="keras_dp_output",
                       help="where the model and plot go (default: %(default)s)")
    train.add_argument("--model-path", default=None,
                       help="the .keras file (default: OUTPUT_DIR/MODEL.keras)")
    train.add_argument("--plot-path", default=None,
                       help="the PNG of the curves (default: OUTPUT_DIR/training_curves.png)")
    train.add_argument("--seed", type=int, default=0,
                       help="seed of initial weights and data order (default: %(default)s)")
    train.add_argument("--ensemble", type=int, default=None, metavar="N",
                       help="train N models from different initial weights (seeds "
                            "SEED..SEED+N-1), N a multiple of the device count or at "
                            "most it, every member on every batch; print each "
                            "member's test accuracy and that of their averaged "
                            "probabilities, and save the averaging model")
    train.add_argument("--verbose", type=int, default=1, choices=[0, 1, 2],
                       help="Keras progress output: 0 none, 1 bar, 2 a line per epoch")
    _add_launch_parser(commands)
    return parser


def _add_launch_parser(commands):
    launch = commands.add_parser(
        "launch", help="run a command as P joined processes on this machine",
        description="Start P processes on this machine that join one "
                    "multi-process JAX run over loopback, as P hosts would: "
                    "keras-dp launch --processes 2 --cpu-devices 2 -- train --epochs 1",
    )
    launch.add_argument("--processes", type=int, default=2, help="default: %(default)s")
    launch.add_argument("--cpu-devices", type=int, default=None, metavar="N",
                        help="give each process N simulated CPU devices")
    launch.add_argument("--port", type=int, default=None,
                        help="the coordinator's port on 127.0.0.1 (default: a free one)")
    launch.add_argument("launched", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                        help="a keras-dp command (train ...) or any program and its arguments")


def main(argv=None):
    """Run `keras-dp` with `argv` (default: the command line)."""
    args = build_parser().parse_args(argv)
    if args.command == "launch":
        from keras_dp.launch import launch

        launched = args.launched[1:] if args.launched[:1] == ["--"] else args.launched
        raise SystemExit(launch(launched, args.processes, args.cpu_devices, args.port))
    if args.cpu_devices is not None:
        use_cpu_devices(args.cpu_devices)
    from keras_dp import distributed

    if distributed.requested_by_environment():  # started by `keras-dp launch` or by hand
        distributed.initialize()
    if args.command == "train" and args.ensemble is not None:
        train_ensemble(args)
    elif args.command == "train":
        train(args)


def use_cpu_devices(count):
    """Make JAX start with `count` simulated CPU devices.

    Raises:
        ValueError: `count` is below 1.
        RuntimeError: JAX has already started a backend (too late to change).
    """
    if count < 1:
        raise ValueError(f"--cpu-devices must be at least 1. Received: {count}.")
    # JAX is always imported here (through Keras); what matters is whether it
    # has started a backend yet. There is no public way to ask this.
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise RuntimeError(
            "JAX has already started, so the number of CPU devices can no "
            "longer change. Set XLA_FLAGS=--xla_force_host_platform_device_count"
            f"={count} before starting Python, or restart the kernel."
        )
    flags = [
        flag for flag in os.environ.get("XLA_FLAGS", "").split()
        if not flag.startswith("--xla_force_host_platform_device_count")
    ]
    os.environ["XLA_FLAGS"] = " ".join(
        flags + [f"--xla_force_host_platform_device_count={count}"]
    )
    os.environ["JAX_PLATFORMS"] = "cpu"


def train(args):
    """The main job: train, report, evaluate, save."""
    import jax

    import keras_dp
    from keras_dp import distributed
    from keras_dp.plots import plot_history

    keras.utils.set_random_seed(args.seed)
    (x_train, y_train), (x_test, y_test), source = _mnist(args.data_dir, args.train_samples)
    samples = len(x_train)
    print = builtins.print if distributed.is_primary() else _silent  # noqa: A001
    model = keras_dp.models.compile_classifier(
        keras_dp.models.MODELS[args.model](), learning_rate=args.learning_rate
    )
    trainer = keras_dp.ShardedTrainer(model, seed=args.seed)
    print(f"keras_dp {keras_dp.__version__} | jax {jax.__version__} | keras {keras.__version__}")
    print(f"Data: {source}: {len(x_train)} training and {len(x_test)} test images")
    local_batch = args.batch_size
    if trainer.multiprocess:  # each process trains and tests on its contiguous share
        (x_train, y_train), (x_test, y_test) = (
            distributed.process_share(x_train, y_train), distributed.process_share(x_test, y_test)
        )
        local_batch = distributed.local_batch_size(args.batch_size, trainer.mesh)
        print(f"{jax.process_count()} processes; each reads 1/{jax.process_count()} "
              f"of the data and {local_batch} rows of each global batch")
    first_batch = (x_train[:local_batch], y_train[:local_batch])
    trainer.build(first_batch)
    print(trainer.describe(first_batch))
    # The test set is scored after every epoch (val_* curves); its last
    # score is the test result, so it is computed once per epoch, not again.
    history = trainer.fit(
        x_train, y_train, batch_size=args.batch_size, epochs=args.epochs,
        verbose=args.verbose, validation_data=(x_test, y_test),
        callbacks=[EpochReport(samples, args.epochs)] if distributed.is_primary() else [],
    )
    test = {name: history.history[f"val_{name}"][-1] for name in ("loss", "accuracy")}
    print(f"Test: loss {test['loss']:.4f}  accuracy {test['accuracy']:.4f}")
    if not distributed.is_primary():  # one copy of the files, from process 0
        distributed.barrier("keras_dp.cli.saved")
        return history, test
    output = pathlib.Path(args.output_dir)
    model_path = pathlib.Path(args.model_path or output / f"{args.model}.keras")
    plot_path = pathlib.Path(args.plot_path or output / "training_curves.png")
    for path in (model_path, plot_path):
        path.parent.mkdir(parents=True, exist_ok=True)
    model.save(model_path)
    plot_history(history, plot_path, title=f"{args.model} on MNIST, {trainer.num_devices} device(s)")
    print(f"Saved the model to {model_path} and the training curves to {plot_path}")
    distributed.barrier("keras_dp.cli.saved")
    return history, test


def _silent(*args, **kwargs):
    """`print` on processes other than 0: the report comes from process 0."""


def train_ensemble(args):
    """The main job for `--ensemble N`: train N members, score each and their mean.

    Returns:
        The history and the test scores (`EnsembleTrainer.evaluate`'s dict).
    """
    import jax

    import keras_dp

    (x_train, y_train), (x_test, y_test), source = _mnist(args.data_dir, args.train_samples)

    def build_model():
        return keras_dp.models.compile_classifier(
            keras_dp.models.MODELS[args.model](), learning_rate=args.learning_rate
        )

    trainer = keras_dp.EnsembleTrainer(build_model, args.ensemble, seed=args.seed)
    print(f"keras_dp {keras_dp.__version__} | jax {jax.__version__} | keras {keras.__version__}")
    print(f"Data: {source}: {len(x_train)} training and {len(x_test)} test images")
    print(trainer.describe())
    # The test set is scored after every epoch; the last scores are the result.
    history = trainer.fit(
        x_train, y_train, batch_size=args.batch_size, epochs=args.epochs,
        verbose=args.verbose, validation_data=(x_test, y_test),
    )
    test = {name[len("val_"):]: values[-1] for name, values in history.items()
            if name.startswith("val_")}
    for index, (loss, accuracy) in enumerate(zip(test["loss"], test["accuracy"])):
        print(f"Member {index}: test loss {loss:.4f}  accuracy {accuracy:.4f}")
    print(
        f"Ensemble of {len(trainer.members)}: test loss {test['ensemble_loss']:.4f}  "
        f"accuracy {test['ensemble_accuracy']:.4f}  (members' mean accuracy "
        f"{sum(test['accuracy']) / len(test['accuracy']):.4f})"
    )
    model_path = pathlib.Path(
        args.model_path or pathlib.Path(args.output_dir) / f"{args.model}_ensemble.keras"
    )
    model_path.parent.mkdir(parents=True, exist_ok=True)
    trainer.averaging_model().save(model_path)
    print(f"Saved the averaging model to {model_path}")
    return history, test


def _mnist(data_dir, train_samples):
    from keras_dp import datasets

    path, source = datasets.find_mnist(data_dir)
    (x_train, y_train), (x_test, y_test) = datasets.load_mnist(path)
    if train_samples is not None:
        x_train, y_train = x_train[:train_samples], y_train[:train_samples]
    # The convnet takes (28, 28, 1) images; uint8 keeps host-to-device copies
    # small, and the model's Rescaling layer turns them into floats.
    return (x_train[..., None], y_train), (x_test[..., None], y_test), source


class EpochReport(keras.callbacks.Callback):
    """Prints loss, accuracy, seconds and samples per second after each epoch.

    Seconds cover training only, from epoch start to the end of its last
    step (scoring the test set comes after); the first epoch's include
    compiling the train step.
    """

    def __init__(self, samples, epochs):
        super().__init__()
        self._samples, self._epochs = samples, epochs
        self._start = self._end = None

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self._end = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        seconds = self._end - self._start
        print(
            f"epoch {epoch + 1}/{self._epochs}: loss {logs['loss']:.4f}  "
            f"accuracy {logs['accuracy']:.4f}  {seconds:.1f} s  "
            f"{self._samples / seconds:,.0f} samples/s  "
            f"(test accuracy {logs['val_accuracy']:.4f})",
            flush=True,
        )


if __name__ == "__main__":
    main()
