"""What a user calls: `fit_sharded` (`model.fit` on every device, in one call) and `memory_plan`."""

from keras_dp.trainer import ShardedTrainer


def fit_sharded(model, x=None, y=None, *, epochs=1, batch_size=None,
                validation_split=0.0, validation_data=None, callbacks=None,
                verbose="auto", shuffle=True, class_weight=None,
                sample_weight=None, initial_epoch=0, steps_per_epoch=None,
                validation_steps=None, validation_batch_size=None, validation_freq=1,
                steps_per_execution=None, optimizer=None,
                loss=None, metrics=None, mesh=None, devices=None, seed=0,
                checkpoint_dir=None, checkpoints_to_keep=2, state_sharding="replicated",
                data_on_device="auto", keep_last_good="auto", compilation_cache=True,
                profile_dir=None, micro_batches=1, distribution=None):
    """Train `model` on every device, synchronously, and return its History.

    Each global batch is split by rows over the devices (over the batch
    axis of a `distribution`'s mesh), every device holds the whole model
    (or, under a `distribution`, its part of each variable the layout map
    splits), and gradients are averaged across devices inside each
    compiled step, so the result equals training on one device with the
    same batches (up to float summation order), whatever the batch size:
    a batch that does not divide by the device count is split unevenly,
    never dropped or padded into the result. When the call returns,
    normally or by an exception, the model holds the trained weights.

    `epochs`, `batch_size`, `validation_split`, `validation_data`,
    `callbacks`, `verbose`, `shuffle`, `class_weight`, `initial_epoch`,
    `steps_per_epoch`, `validation_steps`, `validation_batch_size` and
    `validation_freq` mean what they mean in `model.fit` (see
    `ShardedTrainer.fit`); `batch_size` and `validation_batch_size` are
    global batches, of any size.

    Args:
        model: a `keras.Model` (or a layer with Keras's JAX trainer mixed
            in), compiled or not.
        x: arrays (with `y`), a `(x, y[, sample_weight])` tuple, a
            `tf.data.Dataset` of batches, or a re-iterable of batches.
        y, sample_weight: arrays, with array `x` only.
        steps_per_execution: steps per compiled call in training and
            validation (default: the model's, from `compile`); the result
            equals single steps.
        optimizer, loss, metrics: override what the model was compiled with.
        mesh, devices: where to train (default: all of JAX's devices).
        distribution: a `keras.distribution.ModelParallel` (or
            `DataParallel`) to train under instead: on its device mesh,
            each variable laid out as its layout map says, each batch split
            over its `batch_dim_name` axis and replicated over the others,
            still exactly for any batch size. Default: the distribution
            active now (`keras.distribution.set_distribution`, or inside
            `distribution.scope()`), else none. See `ShardedTrainer` and
            docs/guides/model-axis.md.
        seed: seed of the per-epoch shuffle order; the same seed, data and
            device count give bitwise identical weights on CPU.
        checkpoint_dir: save the whole training state there after every
            epoch and on SIGTERM, and resume from it when it holds a
            checkpoint (see `ShardedTrainer.fit`). Not with a
            `keras.callbacks.BackupAndRestore` (a `ValueError`).
        checkpoints_to_keep: how many of the newest checkpoints stay in
            `checkpoint_dir` (orbax's `max_to_keep`; default 2: one older
            in case the newest is damaged).
        state_sharding: `"replicated"` (default), `"optimizer"` or `"full"`:
            keep a full copy of the state on every device (or as the
            `distribution` lays it out), or split the optimizer state, or
            the whole state, over the batch axis too (`keras_dp.sharding`);
            the steps computed are the same.
        profile_dir: write a `jax.profiler` trace of a few steps of the
            first epoch there (see `ShardedTrainer.fit`); `~` is expanded.
        data_on_device: keep array data on the devices and gather each
            step's rows there (`"auto"`, the default: when it fits; `True`;
            `False`); see `ShardedTrainer` and `keras_dp.core.feed`.
        keep_last_good: keep the last completed step's state on the devices,
            so that a step failing at run time loses no completed step
            (`"auto"`, the default: when it fits; `True`; `False`: donate
            it); see `ShardedTrainer`.
        compilation_cache: JAX's persistent compilation cache in a per-user
            directory (`True`, the default), a directory, or `False`; see
            `keras_dp.diagnostics.compilation_cache`.
        micro_batches: run each global batch as this many slices, one after
            another inside the compiled step, their gradients summed into
            one update: the same training up to float summation order, with
            about 1/M of the step's activations (`ShardedTrainer`).

    Returns:
        A `keras.callbacks.History`, as `model.fit` returns.

    Example:

    ```python
    import keras_dp  # first: it selects Keras's JAX backend before Keras loads
    import keras

    (x_train, y_train), (x_test, y_test) = keras_dp.datasets.load_mnist()
    x_train, y_train = x_train[:2048, ..., None], y_train[:2048]
    x_test, y_test = x_test[:512, ..., None], y_test[:512]

    model = keras_dp.models.convnet()
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    history = keras_dp.fit_sharded(model, x_train, y_train, batch_size=64, epochs=1,
                                   validation_data=(x_test, y_test))
    print(history.history["val_accuracy"])  # the model holds the trained weights
    ```
    """
    trainer = ShardedTrainer(
        model, optimizer=optimizer, loss=loss, metrics=metrics, mesh=mesh,
        devices=devices, seed=seed, steps_per_execution=steps_per_execution,
        state_sharding=state_sharding, data_on_device=data_on_device,
        keep_last_good=keep_last_good, compilation_cache=compilation_cache,
        micro_batches=micro_batches, distribution=distribution,
    )
    return trainer.fit(
        x, y, batch_size=batch_size, epochs=epochs, verbose=verbose,
        callbacks=callbacks, validation_split=validation_split,
        validation_data=validation_data, shuffle=shuffle,
        class_weight=class_weight, sample_weight=sample_weight,
        initial_epoch=initial_epoch, steps_per_epoch=steps_per_epoch,
        validation_steps=validation_steps, validation_batch_size=validation_batch_size,
        validation_freq=validation_freq, checkpoint_dir=checkpoint_dir,
        checkpoints_to_keep=checkpoints_to_keep, profile_dir=profile_dir,
    )


def memory_plan(model, x, y=None, *, batch_size=32, sample_weight=None, devices=None,
                mesh=None, state_sharding="replicated", optimizer=None, loss=None,
                metrics=None, data_on_device=False, micro_batches=1, capacity=None,
                distribution=None):
    """Plan the memory of training `model` on `devices` before running it.

    Args:
        model: a `keras.Model`, compiled or given `optimizer`/`loss`.
        x, y, sample_weight: a few rows of the data as arrays, for their
            shapes (all of it with `data_on_device`), read as `fit` reads
            them.
        batch_size: the global batch to plan for.
        devices, mesh, state_sharding, optimizer, loss, metrics,
            distribution: as for `ShardedTrainer`.
        data_on_device: False (the default): plan the step fed from the
            host. True or "auto" (as `ShardedTrainer`'s): `x`, `y` and
            `sample_weight` are the whole training data, and when a fit
            with that setting keeps them on the devices, the plan is of its
            step over the resident data (whose arguments then include the
            data, every device holding all of it).
        micro_batches: as for `ShardedTrainer`: the step planned runs
            each batch in that many slices.
        capacity: the bytes of one device to plan for (a device other than
            these, or a budget below theirs); default what the devices
            report (nothing on CPU). Where the step exceeds it, the plan
            lists the changes that would fit (`MemoryPlan.remedies`).

    Returns:
        A `keras_dp.diagnostics.memory.MemoryPlan` (print it for a summary):
        per device, the bytes of weights, optimizer and metrics as laid
        out (each variable's layout and bytes in `variables`), and the
        compiled step's arguments, temporaries and peak from XLA's memory
        analysis, of the step a fit would run. On XLA:CPU that is the one `keep_last_good` picks, and a fit on batches of this size
        finds it compiled; on accelerators it is the step that donates its
        state, whose plan a fit reads to choose.

    Raises:
        ValueError: `data_on_device=True` and data a fit could not keep on
            the devices (see `keras_dp.core.feed`); data that is not arrays
            (a dataset, a list of batches).
    """
    trainer = ShardedTrainer(model, optimizer=optimizer, loss=loss, metrics=metrics,
                             devices=devices, mesh=mesh, state_sharding=state_sharding,
                             micro_batches=micro_batches, distribution=distribution)
    return trainer.memory_plan(x, y, batch_size=batch_size, sample_weight=sample_weight,
                               data_on_device=data_on_device, capacity=capacity)
