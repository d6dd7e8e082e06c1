"""`fit_sharded`: `model.fit` on every local device, in one call."""

from keras_dp.trainer import ShardedTrainer


def fit_sharded(model, x=None, y=None, *, epochs=1, batch_size=None,
                validation_data=None, callbacks=None, verbose="auto",
                shuffle=True, sample_weight=None, optimizer=None, loss=None,
                metrics=None, mesh=None, devices=None, seed=0):
    """Train `model` with synchronous data parallelism and return its History.

    Each global batch is split by rows over the devices, every device holds
    the whole model, and gradients are averaged across devices inside each
    compiled step, so the result equals training on one device with the
    same batches (up to float summation order). When the call returns,
    normally or by an exception, the model holds the trained weights.

    Args:
        model: a `keras.Model`, compiled or not.
        x: arrays (with `y`), a `(x, y[, sample_weight])` tuple, a
            `tf.data.Dataset` of batches, or a re-iterable of batches.
        y, sample_weight: arrays, with array `x` only.
        epochs, batch_size, validation_data, callbacks, verbose, shuffle: as
            in `model.fit`; `batch_size` is the global batch, a multiple of
            the device count.
        optimizer, loss, metrics: override what the model was compiled with.
        mesh, devices: where to train (default: all of JAX's devices).
        seed: seed of the per-epoch shuffle order.

    Returns:
        A `keras.callbacks.History`, as `model.fit` returns.

    Example:

    ```python
    import keras_dp

    model = keras_dp.models.convnet()
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), metrics=["accuracy"])
    history = keras_dp.fit_sharded(model, x_train, y_train, batch_size=64, epochs=2)
    ```
    """
    trainer = ShardedTrainer(
        model, optimizer=optimizer, loss=loss, metrics=metrics, mesh=mesh,
        devices=devices, seed=seed,
    )
    return trainer.fit(
        x, y, batch_size=batch_size, epochs=epochs, verbose=verbose,
        callbacks=callbacks, validation_data=validation_data, shuffle=shuffle,
        sample_weight=sample_weight,
    )
