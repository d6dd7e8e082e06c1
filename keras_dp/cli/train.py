"""`keras-dp train`: the main job, on MNIST, with a report of what ran where."""

import builtins
import pathlib
import time

import keras


def train(args):
    """The main job: train, report, evaluate, save."""
    import jax

    import keras_dp
    import keras_dp.compilation_cache
    from keras_dp import distributed
    from keras_dp.cli.plots import plot_history

    # Before the model exists, so a rerun loads its initializers' programs
    # from the cache too (`benchmarks/compile_cache.py`).
    keras_dp.compilation_cache.enable(min_compile_time_s=0.1)
    keras.utils.set_random_seed(args.seed)
    (x_train, y_train), (x_test, y_test), source = _mnist(args.data_dir, args.train_samples)
    samples = len(x_train)
    print = builtins.print if distributed.is_primary() else _silent  # noqa: A001
    model = keras_dp.models.compile_classifier(
        keras_dp.models.MODELS[args.model](), learning_rate=args.learning_rate
    )
    data_on_device = {"auto": "auto", "true": True, "false": False}[args.data_on_device]
    trainer = keras_dp.ShardedTrainer(model, seed=args.seed, data_on_device=data_on_device,
                                      state_sharding=args.state_sharding)
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
    if not trainer.multiprocess:
        print(trainer.memory_plan(*first_batch, batch_size=args.batch_size))
    # The test set is scored after every epoch (val_* curves); its last
    # score is the test result, so it is computed once per epoch, not again.
    history = trainer.fit(
        x_train, y_train, batch_size=args.batch_size, epochs=args.epochs,
        verbose=args.verbose, validation_data=(x_test, y_test),
        callbacks=[EpochReport(samples, args.epochs, trainer)] if distributed.is_primary() else [],
        profile_dir=args.profile,
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
    compiling the train step. Then, once the epoch is over (at the next
    epoch's start, or the end of training), where its time went
    (`trainer.timings`, `keras_dp.timing.describe`).
    """

    def __init__(self, samples, epochs, trainer=None):
        super().__init__()
        self._samples, self._epochs, self._trainer = samples, epochs, trainer
        self._start = self._end = None
        self._described = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._describe_finished_epochs()
        self._start = time.perf_counter()

    def on_train_end(self, logs=None):
        self._describe_finished_epochs()

    def _describe_finished_epochs(self):
        from keras_dp import timing

        timings = self._trainer.timings if self._trainer is not None else []
        for entry in timings[self._described:]:
            print(f"  {timing.describe(entry)}", flush=True)
        self._described = len(timings)

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

