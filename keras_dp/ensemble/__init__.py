"""Ensembles across devices: one member per device, probabilities averaged.

An ensemble of `M` models of one architecture, each from its own random
initialisation, trains as one compiled step: the members' state is stacked
on a member axis split over the devices (`keras_dp.ensemble.members`), every device
receives each batch whole, and updates only its own members
(`keras_dp.ensemble.steps`), with no cross-device communication at all. The
ensemble predicts the mean of its members' class probabilities; only
evaluation and prediction bring the members together, on the host.
"""

from typing import NamedTuple

import keras

from keras_dp.ensemble import trainer as ensemble_trainer
from keras_dp.ensemble.trainer import EnsembleTrainer

__all__ = ["EnsembleResult", "EnsembleTrainer", "fit_ensemble"]


class EnsembleResult(NamedTuple):
    """What `fit_ensemble` returns.

    Attributes:
        members: the `M` trained Keras models, member `i` at index `i`.
        model: a Keras model of the members that outputs the mean of their
            class probabilities (`EnsembleTrainer.averaging_model`).
        history: the `keras.callbacks.History` of `EnsembleTrainer.fit`:
            members' means and the ensemble's validation scores per epoch.
        member_history: each member's own logs per epoch
            (`EnsembleTrainer.member_history`).
    """

    members: list
    model: keras.Model
    history: keras.callbacks.History
    member_history: dict


def fit_ensemble(build_model, x=None, y=None, *, members=None, batch_size=None,
                 epochs=1, verbose="auto", callbacks=None, validation_split=0.0,
                 validation_data=None, shuffle=True, member_shuffle=False,
                 class_weight=None, sample_weight=None, initial_epoch=0,
                 steps_per_epoch=None, validation_steps=None, validation_batch_size=None,
                 validation_freq=1, steps_per_execution=None, from_logits=None,
                 seed=0, mesh=None, devices=None, compilation_cache=True,
                 checkpoint_dir=None, state_sharding=None):
    """Train an ensemble, one member per device, that averages probabilities.

    Member `i` is `build_model()` called right after
    `keras.utils.set_random_seed(seed + i)`, and every member trains on the
    same batches (with `member_shuffle`, member `i` shuffles with seed
    `seed + i` instead). So member `i` of a run with `shuffle=False` is
    the model that `keras.utils.set_random_seed(seed + i)`,
    `model = build_model()`, `model.fit(x, y, batch_size=batch_size,
    epochs=epochs, shuffle=False)` trains alone.

    Args:
        build_model: a function of no arguments returning a new compiled
            multi-class classifier (`keras.Model`) on each call; or a
            `keras.Model`, which is cloned with fresh weights and compiled
            like it.
        x, y, sample_weight: training data, as for `fit_sharded`.
        class_weight: `{class_id: weight}`, applied as sample weights, as
            in `model.fit`.
        members: the ensemble size `M` (default: the device count `D`). Up
            to `D`, member `i` runs on device `i`; a multiple of `D` puts
            `M / D` members on each device.
        batch_size, epochs, shuffle, initial_epoch: as in `model.fit`; each
            member trains on every batch whole, for epochs `initial_epoch`
            to `epochs - 1` (epoch `e` shuffles as in an unbroken run).
        verbose: 0 silent; 1 or "auto" Keras's progress bar, 2 one line
            per epoch; the logs are the members' means and the ensemble's
            validation scores.
        callbacks: Keras callbacks, given the ensemble's averaging model,
            whose weights are the members' (see `EnsembleTrainer.fit`).
        steps_per_epoch: run this many steps per epoch, drawing batches
            from one continuing stream, as `fit_sharded` does (for endless
            datasets).
        validation_split: hold out this last fraction of array data (taken
            before shuffling) as the validation data, as in `model.fit`.
        validation_data: `(x, y[, sample_weight])` or a dataset, scored
            after each epoch for every member and for the ensemble.
        validation_freq: validate every this many epochs (an int), or
            after the listed epochs (1-based), as in `model.fit`.
        validation_steps, validation_batch_size: as in `model.fit`: score
            the first this many validation batches; the batch size of
            validation arrays (default `batch_size`).
        steps_per_execution: training steps per compiled call, as in
            `fit_sharded`.
        member_shuffle: give each member its own shuffle order.
        from_logits: whether the models output logits (a softmax comes
            before averaging); `None` reads it from the compiled loss.
        seed: seed of the members' initialisations and of the data order,
            an int of at least 0.
        mesh, devices: where to train (default: all of JAX's devices).
        compilation_cache: JAX's persistent compilation cache, as for
            `ShardedTrainer`: a rerun loads the compiled steps from disk.
        checkpoint_dir: not supported for ensembles: anything but None
            raises a `ValueError` before any member is built, naming
            `keras.callbacks.BackupAndRestore` to use instead.
        state_sharding: not supported for ensembles, whose members each
            live whole on a device: anything but None raises a
            `ValueError` before any member is built, saying so and what to
            use for a model too large for one device (`fit_sharded`).

    Returns:
        `EnsembleResult(members, model, history, member_history)`.

    Example:

    ```python
    import keras_dp  # first: it selects Keras's JAX backend before Keras loads

    (x_train, y_train), (x_test, y_test) = keras_dp.datasets.load_mnist()
    x_train, y_train = x_train[:512, ..., None], y_train[:512]
    x_test = x_test[:512, ..., None]

    def build_model():
        return keras_dp.models.compile_classifier(keras_dp.models.convnet())

    result = keras_dp.fit_ensemble(build_model, x_train, y_train,
                                   batch_size=64, epochs=1)
    probabilities = result.model.predict(x_test)  # the members' mean
    ```
    """
    ensemble_trainer.refuse_checkpoint_dir(checkpoint_dir)  # before the members are built
    trainer = EnsembleTrainer(
        build_model, members, seed=seed, mesh=mesh, devices=devices,
        from_logits=from_logits, steps_per_execution=steps_per_execution,
        compilation_cache=compilation_cache, state_sharding=state_sharding,
    )
    history = trainer.fit(
        x, y, batch_size=batch_size, epochs=epochs, verbose=verbose,
        callbacks=callbacks, validation_split=validation_split,
        validation_data=validation_data, shuffle=shuffle, member_shuffle=member_shuffle,
        class_weight=class_weight, sample_weight=sample_weight, initial_epoch=initial_epoch,
        steps_per_epoch=steps_per_epoch,
        validation_steps=validation_steps, validation_batch_size=validation_batch_size,
        validation_freq=validation_freq, checkpoint_dir=checkpoint_dir,
    )
    return EnsembleResult(trainer.members, trainer.averaging_model(), history,
                          trainer.member_history)
