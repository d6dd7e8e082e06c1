"""The `keras-dp` command: parse arguments, set up devices, call the library.

    keras-dp train --epochs 2 --cpu-devices 2 --data-dir ../shared/data

trains the guide's convnet on MNIST over all local devices, prints what ran
where and how fast, then the test set's scores, and saves the model
(`.keras`) and its training curves (PNG).

Parsing imports nothing but the standard library, so `--help` and argument
errors return at once; Keras and JAX load only for a command that runs.
"""

import argparse
import os
import sys

from keras_dp.cli import defaults

# The exit status after Ctrl-C, as a shell gives a command that SIGINT ended (128 + 2).
INTERRUPTED_STATUS = 130


def positive_int(text):
    """An argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text):
    """An argparse type: a number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {value}")
    return value


def port_number(text):
    """An argparse type: a TCP port, 1 to 65535."""
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port, 1 to 65535, got {value}")
    return value


def build_parser():
    """Return the argument parser of `keras-dp`."""
    parser = argparse.ArgumentParser(
        prog="keras-dp",
        description="Synchronous data-parallel training of Keras models on JAX devices.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_train_parser(commands)
    _add_launch_parser(commands)
    return parser


def _add_train_parser(commands):
    train = commands.add_parser(
        "train", help="train a model on MNIST over all local devices",
        description="Train a model on MNIST with data parallelism over all local devices.",
    )
    train.add_argument("--model", default="convnet", choices=["convnet", "resnet18"],
                       help="the model to train (default: %(default)s)")
    train.add_argument("--epochs", type=positive_int, default=None,
                       help=f"default: {defaults.DEFAULT_EPOCHS} on full MNIST, "
                            f"{defaults.DEFAULT_EPOCHS_ON_THE_SUBSET} on the bundled subset")
    train.add_argument("--batch-size", type=positive_int, default=64,
                       help="global batch, split over the devices (default: %(default)s)")
    train.add_argument("--learning-rate", type=positive_float, default=1e-3,
                       help="Adam's learning rate at the start; it decays to 0 along a "
                            "cosine over the run (default: %(default)s)")
    train.add_argument("--data-dir", default=None,
                       help="a directory with mnist.npz (default: $KERAS_DP_DATA_DIR, "
                            "Keras's cache, a download, then the bundled subset)")
    train.add_argument("--train-samples", type=positive_int, default=None,
                       help="train on the first N images only (default: all)")
    train.add_argument("--cpu-devices", type=positive_int, default=None, metavar="N",
                       help="run on N simulated CPU devices (sets XLA_FLAGS and "
                            "JAX_PLATFORMS=cpu before JAX starts; default: "
                            f"{defaults.DEFAULT_CPU_DEVICES} on a machine without GPU or TPU)")
    train.add_argument("--output-dir", default="keras_dp_output",
                       help="where the model and plot go (default: %(default)s)")
    train.add_argument("--model-path", default=None,
                       help="the .keras file (default: OUTPUT_DIR/MODEL.keras, "
                            "OUTPUT_DIR/MODEL_ensemble.keras with --ensemble)")
    train.add_argument("--plot-path", default=None,
                       help="the PNG of the curves (default: OUTPUT_DIR/training_curves.png)")
    train.add_argument("--seed", type=int, default=0,
                       help="seed of initial weights and data order (default: %(default)s)")
    train.add_argument("--ensemble", type=positive_int, default=None, metavar="N",
                       help="train N models from different initial weights (seeds "
                            "SEED..SEED+N-1), N a multiple of the device count or at "
                            "most it, every member on every batch; print each "
                            "member's test accuracy and that of their averaged "
                            "probabilities, and save the averaging model")
    train.add_argument("--state-sharding", default="replicated",
                       choices=["replicated", "optimizer", "full"],
                       help="keep the whole training state on every device, or split "
                            "the optimizer state, or all of it, over the devices "
                            "(default: %(default)s)")
    train.add_argument("--verbose", type=int, default=None, choices=[0, 1, 2],
                       help="Keras progress output: 0 none, 1 bar, 2 a line per epoch "
                            "(default: 1 on a terminal, 2 into a file or pipe)")
    train.add_argument("--profile", default=None, metavar="DIR",
                       help="write a jax.profiler trace of 5 steps of the first epoch "
                            "(after the first, which compiles) to DIR, for TensorBoard")
    train.add_argument("--data-on-device", default="auto", choices=["auto", "true", "false"],
                       help="keep the training arrays on the devices and gather each "
                            "step's rows there (without --ensemble): auto (when they fit), true, "
                            "or false (copy every batch from the host) (default: %(default)s)")


def _add_launch_parser(commands):
    launch = commands.add_parser(
        "launch", help="run a command as P joined processes on this machine",
        description="Start P processes on this machine that join one "
                    "multi-process JAX run over loopback, as P hosts would: "
                    "keras-dp launch --processes 2 --cpu-devices 2 -- train --epochs 1",
    )
    launch.add_argument("--processes", type=positive_int, default=2, metavar="P",
                        help="how many processes to start (default: %(default)s)")
    launch.add_argument("--cpu-devices", type=positive_int, default=None, metavar="N",
                        help="give each process N simulated CPU devices")
    launch.add_argument("--port", type=port_number, default=None,
                        help="the coordinator's port on 127.0.0.1 (default: a free one)")
    launch.add_argument("launched", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                        help="a keras-dp command (train ...), a Python file (run with this "
                             "Python) or any program, and its arguments")


def main(argv=None):
    """Run `keras-dp` with `argv` (default: the command line).

    Ctrl-C during `train` prints one line, then ends the process at once
    (`os._exit(130)`, so not back to a caller): nothing is saved before
    training ends.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "ensemble", None) is not None:
        _check_ensemble(parser, args)
    if args.command == "train":
        _check_output_paths(parser, args)
    data_dir = getattr(args, "data_dir", None)
    if data_dir is not None and not os.path.isfile(
            os.path.join(data_dir, "mnist.npz") if os.path.isdir(data_dir) else data_dir):
        # Checked here, before Keras and JAX load, as the other arguments are.
        parser.error(f"--data-dir: no MNIST file at {data_dir}. Pass a directory that "
                     "holds mnist.npz (Keras's layout), or the file itself.")
    if args.command == "launch":
        from keras_dp.cli.launch import launch
        from keras_dp.cli.launch import program

        launched = args.launched[1:] if args.launched[:1] == ["--"] else args.launched
        try:
            program(launched)  # before any child starts
        except ValueError as error:
            parser.error(str(error))
        raise SystemExit(launch(launched, args.processes, args.cpu_devices, args.port))
    args.files = {}  # each file written or being written: whether it is complete
    try:
        _train(parser, args)
    except KeyboardInterrupt:
        # One line, not Python's traceback from wherever the signal landed;
        # then out at once: a compile that Ctrl-C interrupted (XLA's
        # compile_and_load raises KeyboardInterrupt and leaves it behind)
        # made Python's normal exit crash with SIGSEGV in 4 of 7 trials
        # after the line (0 of 6 with os._exit).
        print(interrupted_message(args.files), file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(INTERRUPTED_STATUS)


def interrupted_message(files):
    """The line `keras-dp train` ends with on Ctrl-C.

    Args:
        files: each file the run wrote or was writing, and whether it is complete.
    """
    if not files:
        return ("keras-dp train: stopped by Ctrl-C; nothing was saved (the model and the "
                "training curves are written when training ends).")
    done = [path for path, complete in files.items() if complete]
    partial = [path for path, complete in files.items() if not complete]
    parts = ([f"wrote {', '.join(done)}"] if done else []) + (
        [f"{', '.join(partial)} may be incomplete"] if partial else [])
    return f"keras-dp train: stopped by Ctrl-C after training; {'; '.join(parts)}."


def _train(parser, args):
    """`keras-dp train` once its arguments are checked: devices, then the job."""
    # The command itself never imports TensorFlow (it seeds with
    # `_compat.set_random_seed`); should anything else, its C++ start-up
    # notes would clutter the report. The oneDNN one only goes with its
    # option, which affects TensorFlow's own ops, and the command runs none.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    from keras_dp import distributed

    if args.ensemble is not None and distributed.requested_by_environment():
        parser.error("--ensemble trains in one process, on this host's devices, but "
                     "KERAS_DP_COORDINATOR asks to join several (keras-dp launch sets "
                     "it). Run keras-dp train --ensemble N without launch.")
    if args.cpu_devices is not None:
        defaults.use_cpu_devices(args.cpu_devices)
    elif not distributed.requested_by_environment():
        args.default_cpu_devices = defaults.default_cpu_devices(os.environ)
    if distributed.requested_by_environment():  # started by `keras-dp launch` or by hand
        distributed.initialize()
    from keras_dp.cli import train

    if args.ensemble is not None:
        import jax

        # The device count is known only now, when --cpu-devices is not given.
        devices = jax.devices()
        misfit = ensemble_misfit(args.ensemble, len(devices),
                                 f"the {len(devices)} {devices[0].platform} devices")
        if misfit:
            parser.error(f"{misfit}, or choose the device count with --cpu-devices N.")
        train.train_ensemble(args)
    else:
        train.train(args)


def _check_ensemble(parser, args):
    """Refuse, before anything loads, the options `--ensemble` would not honour."""
    if args.state_sharding != "replicated":
        parser.error("--state-sharding splits one model's state over the devices; an "
                     "ensemble already keeps each member on its own device. Drop one.")
    # The ensemble trains from the host, draws no curves and takes no trace:
    # refused rather than silently ignored.
    for option, given in [("--data-on-device", args.data_on_device != "auto"),
                          ("--plot-path", args.plot_path is not None),
                          ("--profile", args.profile is not None)]:
        if given:
            parser.error(f"{option} applies to one model's training, not to --ensemble, "
                         "which saves only the averaging model. Drop one.")
    devices = args.cpu_devices
    misfit = devices and ensemble_misfit(args.ensemble, devices, f"--cpu-devices {devices}")
    if misfit:
        parser.error(f"{misfit}.")


def ensemble_misfit(members, devices, named):
    """Why `members` ensemble members cannot share `devices` devices (`named` in the text), or None.

    Every device holds the same number of members (`keras_dp.ensemble`).
    """
    if members <= devices or members % devices == 0:
        return None
    return (f"--ensemble {members} does not fit {named}: every device holds the same "
            f"number of members. Use at most {devices} members, or a multiple of {devices}")


def _check_output_paths(parser, args):
    """Refuse, before anything loads, an output path that training would fail to write.

    The model and the curves are written after training, and the trace
    after its first step: a path that cannot be written ended a whole run
    in a traceback. `~` is expanded, as the shell does for a separate word.
    """
    for name in ("output_dir", "model_path", "plot_path", "profile"):
        if getattr(args, name) is not None:
            setattr(args, name, os.path.expanduser(getattr(args, name)))
    model_path = args.model_path or os.path.join(args.output_dir, "MODEL.keras")
    plot_path = args.plot_path or os.path.join(args.output_dir, "training_curves.png")
    if not model_path.endswith((".keras", ".h5")):
        parser.error(f"--model-path must end in .keras (or .h5, Keras's legacy format), as "
                     f"Keras's model.save requires. Received: {args.model_path}.")
    if not plot_path.lower().endswith(".png"):
        parser.error("--plot-path must end in .png: the training curves are a PNG. "
                     f"Received: {args.plot_path}.")
    for option, path, directory in [
            ("--output-dir", args.output_dir, args.output_dir),
            ("--model-path", model_path, os.path.dirname(model_path)),
            ("--plot-path", plot_path, os.path.dirname(plot_path)),
            ("--profile", args.profile, args.profile)]:
        if path is None:
            continue
        if path != directory and os.path.isdir(path):
            parser.error(f"{option}: {path} is a directory; give the file's path.")
        problem = _directory_problem(directory or ".")
        if problem:
            parser.error(f"{option}: cannot write {path}: {problem}. Pass a path in a "
                         "directory you can write to.")


def _directory_problem(directory):
    """Why `directory` cannot be made and written into, or None."""
    directory = os.path.abspath(directory)
    if os.path.exists(directory) and not os.path.isdir(directory):
        return f"{directory} exists and is not a directory"
    existing = directory
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{existing} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return None
