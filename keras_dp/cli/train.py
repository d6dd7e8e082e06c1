"""`keras-dp train`: the main job, on MNIST, with a report of what ran where."""

import builtins
import collections
import pathlib
import sys

import jax
import keras

import keras_dp
from keras_dp import _compat
from keras_dp import datasets
from keras_dp import distributed
from keras_dp.cli.defaults import DEFAULT_EPOCHS
from keras_dp.cli.defaults import DEFAULT_EPOCHS_ON_THE_SUBSET
from keras_dp.cli.plots import plot_history
from keras_dp.diagnostics import compilation_cache
from keras_dp.diagnostics import timing

Mnist = collections.namedtuple("Mnist", "train test source bundled")


def train(args):
    """The main job: train, report, evaluate, save.

    Returns:
        The `keras.callbacks.History` and the final `{"val_loss", "val_accuracy"}`.
    """
    # Before the model exists, so a rerun loads its initializers' programs
    # from the cache too (`benchmarks/compile_cache.py`).
    compilation_cache.enable(min_compile_time_s=0)
    _compat.set_random_seed(args.seed)  # Keras's, without importing TensorFlow
    data = load_data(args.data_dir, args.train_samples)
    epochs = epochs_for(args, data)
    print = builtins.print if distributed.is_primary() else _silent  # noqa: A001
    model = compiled_model(args, data, epochs)
    data_on_device = {"auto": "auto", "true": True, "false": False}[args.data_on_device]
    trainer = keras_dp.ShardedTrainer(model, seed=args.seed, data_on_device=data_on_device,
                                      state_sharding=args.state_sharding)
    print(f"keras_dp {keras_dp.__version__} | jax {jax.__version__} | keras {keras.__version__}")
    for line in describe_run(args, data, epochs, trainer):
        print(line)
    (x_train, y_train), (x_test, y_test), local_batch = _process_share(data, args, trainer, print)
    first_batch = (x_train[:local_batch], y_train[:local_batch])
    trainer.build(first_batch)
    print(trainer.describe(first_batch, x_train, y_train))
    if not trainer.multiprocess:
        # Of the step the fit will run: over the data kept on the devices, if it is.
        print(trainer.memory_plan(x_train, y_train, batch_size=args.batch_size,
                                  data_on_device=data_on_device))
    # The test set is scored after every epoch (val_* curves); its last
    # score is the result, so it is computed once per epoch, not again.
    history = trainer.fit(
        x_train, y_train, batch_size=args.batch_size, epochs=epochs,
        verbose=_verbose(args), validation_data=(x_test, y_test),
        callbacks=[EpochReport(trainer)] if distributed.is_primary() else [],
        profile_dir=args.profile,
    )
    scores = {name: history.history[name][-1] for name in ("val_loss", "val_accuracy")}
    epochs_run = f"{len(history.epoch)} epoch" + ("s" if len(history.epoch) != 1 else "")
    print(f"After {epochs_run}: val_loss {scores['val_loss']:.4f}  "
          f"val_accuracy {scores['val_accuracy']:.4f} (on the {len(data.test[0])} test images)")
    if args.profile:  # written during epoch 1; where it went, once the run is done
        print(f"Profile: a jax.profiler trace of 5 calls of epoch 1 is in {args.profile} "
              "(plugins/profile/<run>/*.xplane.pb: open it with TensorBoard's profile "
              "plugin or xprof)")
    if distributed.is_primary():  # one copy of the files, from process 0
        _save(args, model, history, _plot_title(args, data, trainer), trainer.timings)
    distributed.barrier("keras_dp.cli.saved")
    return history, scores


def _silent(*args, **kwargs):
    """`print` on processes other than 0: the report comes from process 0."""


def load_data(data_dir, train_samples):
    """MNIST as the convnet takes it, and where it came from (`Mnist`).

    Images keep their `(28, 28, 1)` uint8 pixels: uint8 keeps
    host-to-device copies small, and the model's Rescaling layer turns
    them into floats.
    """
    path, source = datasets.find_mnist(data_dir)
    (x_train, y_train), (x_test, y_test) = datasets.load_mnist(path)
    if train_samples is not None:
        x_train, y_train = x_train[:train_samples], y_train[:train_samples]
    bundled = path == datasets.BUNDLED_MNIST
    return Mnist((x_train[..., None], y_train), (x_test[..., None], y_test), source, bundled)


def compiled_model(args, data, epochs):
    """A new `--model`, compiled with Adam at `--learning-rate` decaying to 0 over the run."""
    return keras_dp.models.compile_classifier(
        keras_dp.models.MODELS[args.model](), learning_rate=args.learning_rate,
        decay_steps=-(-len(data.train[0]) // args.batch_size) * epochs,
    )


def epochs_for(args, data):
    """`--epochs`, or the default for the data: more passes over the small subset."""
    if args.epochs is not None:
        return args.epochs
    return DEFAULT_EPOCHS_ON_THE_SUBSET if data.bundled else DEFAULT_EPOCHS


def describe_run(args, data, epochs, trainer):
    """The lines that say which data, how long, and why these devices."""
    lines = [f"Data: {data.source}"]
    if data.bundled:
        lines.append("  Pass --data-dir DIR (a directory with mnist.npz) or set "
                     "KERAS_DP_DATA_DIR for full MNIST.")
    lines.append(f"  {len(data.train[0])} training images; the {len(data.test[0])} test "
                 "images are the validation data, scored after each epoch (val_loss, "
                 "val_accuracy)")
    why = ""
    if args.epochs is None and data.bundled:
        why = " (the default on the bundled subset, whose epochs are short)"
    lines.append(f"  {epochs} epoch{'s' if epochs != 1 else ''}{why}; Adam's learning rate {args.learning_rate:g} "
                 "decays to 0 along a cosine over the run")
    platform = trainer.mesh.devices.flat[0].platform
    if getattr(args, "default_cpu_devices", False) and platform == "cpu":
        lines.append(f"No GPU or TPU: training on {trainer.num_devices} simulated CPU devices "
                     "to show the data parallelism (--cpu-devices N to choose)")
    return lines


def _process_share(data, args, trainer, print):  # noqa: A002
    """This process's training and test rows, and its rows of each global batch."""
    if not trainer.multiprocess:
        return data.train, data.test, args.batch_size
    # Each process trains and tests on its contiguous share.
    local_batch = distributed.local_batch_size(args.batch_size, trainer.mesh)
    print(f"{jax.process_count()} processes; each reads 1/{jax.process_count()} "
          f"of the data and {local_batch} rows of each global batch")
    return (distributed.process_share(*data.train), distributed.process_share(*data.test),
            local_batch)


def _verbose(args):
    """`--verbose`, else a redrawn bar on a terminal and a line per epoch in a file."""
    if args.verbose is not None:
        return args.verbose
    return 1 if sys.stdout.isatty() else 2


def _plot_title(args, data, trainer):
    which = "the bundled MNIST subset" if data.bundled else "MNIST"
    return (f"{args.model}: {len(data.train[0]):,} training images of {which}, "
            f"{trainer.num_devices} device(s); val_loss, val_accuracy: the "
            f"{len(data.test[0]):,} test images")


def _save(args, model, history, title, timings):
    output = pathlib.Path(args.output_dir)
    model_path = pathlib.Path(args.model_path or output / f"{args.model}.keras")
    plot_path = pathlib.Path(args.plot_path or output / "training_curves.png")
    for path in (model_path, plot_path):
        path.parent.mkdir(parents=True, exist_ok=True)
    args.files[str(model_path)] = False
    model.save(model_path)
    args.files[str(model_path)] = True
    args.files[str(plot_path)] = False
    if plot_history(history, plot_path, title=title, timings=timings):
        args.files[str(plot_path)] = True
        print(f"Saved the model to {model_path} and the training curves to {plot_path}")
    else:
        del args.files[str(plot_path)]  # without matplotlib, nothing was written
        print(f"Saved the model to {model_path}. No training curves: they need matplotlib "
              "(pip install 'keras_dp[plot]').")


def train_ensemble(args):
    """The main job for `--ensemble N`: train N members, score each and their mean.

    Returns:
        The history and the test scores (`EnsembleTrainer.evaluate`'s dict).
    """
    vars(args).setdefault("files", {})
    data = load_data(args.data_dir, args.train_samples)
    (x_train, y_train), (x_test, y_test) = data.train, data.test

    epochs = epochs_for(args, data)

    def build_model():  # each member's rate decays as one model's does (--learning-rate)
        return compiled_model(args, data, epochs)

    trainer = keras_dp.EnsembleTrainer(build_model, args.ensemble, seed=args.seed)
    print(f"keras_dp {keras_dp.__version__} | jax {jax.__version__} | keras {keras.__version__}")
    print(f"Data: {data.source}: {len(x_train)} training and {len(x_test)} test images")
    print(trainer.describe())
    # The test set is scored after every epoch; the last scores are the result.
    history = trainer.fit(
        x_train, y_train, batch_size=args.batch_size, epochs=epochs,
        verbose=_verbose(args), validation_data=(x_test, y_test),
    )
    test = {name[len("val_"):]: values[-1] for name, values in trainer.member_history.items()
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
    args.files[str(model_path)] = False
    trainer.averaging_model().save(model_path)
    args.files[str(model_path)] = True
    print(f"Saved the averaging model to {model_path}")
    return history, test


class EpochReport(keras.callbacks.ProgbarLogger):
    """Keras's progress bar, then after each epoch a report of it.

    Being the fit's `ProgbarLogger`, it decides the order: the report comes
    after the epoch's bar is finished (never glued to it) and once the
    epoch's timing is known (at the next epoch's start, before its bar, or
    at the end of training). It gives the epoch's logs under Keras's names,
    as in the bar (`loss`, `accuracy`, `val_loss`, `val_accuracy`; only
    with `verbose=0`, as the bar shows them otherwise), then where the
    epoch's time went, its samples per second (training only) and its
    FLOP/s, with the fraction of the devices' peak where known
    (`trainer.timings`, `keras_dp.diagnostics.timing.describe`; the first epoch's time
    includes compiling the train programs).
    """

    def __init__(self, trainer):
        super().__init__()
        self._trainer = trainer
        self._logs = []
        self._reported = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._report()
        super().on_epoch_begin(epoch, logs)

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        self._logs.append((epoch, dict(logs or {})))

    def on_train_end(self, logs=None):
        super().on_train_end(logs)
        self._report()

    def _report(self):
        timings = self._trainer.timings
        while self._reported < min(len(self._logs), len(timings)):
            epoch, logs = self._logs[self._reported]
            if not self.verbose:  # otherwise the bar has shown them
                values = "  ".join(f"{name} {value:.4f}" for name, value in logs.items())
                print(f"epoch {epoch + 1}/{self.epochs}: {values}", flush=True)
            print(f"  {timing.describe(timings[self._reported])}", flush=True)
            self._reported += 1
