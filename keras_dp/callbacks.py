"""Keras's callbacks and logs, as `model.fit` hands them out.

`callback_list` makes the `keras.callbacks.CallbackList` `model.fit` would
(History, progress bar); the rest are Keras's rules for logs and for
`validation_freq`. The Keras model a callback reads is kept current by
`keras_dp.state.LiveModel`. Across processes, Keras's callbacks that
write files run on process 0 only (`for_this_process`).
"""

import jax
import keras
import numpy as np

from keras_dp import _compat
from keras_dp import distributed as distributed_lib
from keras_dp import mesh as mesh_lib


# Keras's callbacks that write files. Across processes every process would
# write the same paths at once (a CSV of interleaved rows, two TensorBoard
# event files per run, a checkpoint torn by two writers).
FILE_WRITERS = (keras.callbacks.ModelCheckpoint, keras.callbacks.CSVLogger,
                keras.callbacks.TensorBoard, keras.callbacks.BackupAndRestore)


def callback_list(callbacks, model, verbose, history=True, primary_writes=True, **params):
    """The `CallbackList` `model.fit` would make: History, and a progress bar
    unless `verbose` is 0 (on process 0 only, across processes).

    `history=False` for `evaluate` and `predict`: as under Keras, they add
    no History, so `model.history` stays the last fit's. `verbose` reaches
    the callbacks' `params` as given (`"auto"` too, as in `model.fit`).
    `primary_writes`: see `for_this_process`.
    """
    if isinstance(callbacks, keras.callbacks.CallbackList):
        return callbacks
    check_callbacks(callbacks)
    if not distributed_lib.is_primary():
        verbose = 0  # one progress bar, on process 0, for all processes
        if primary_writes:
            callbacks = for_this_process(callbacks)
    return keras.callbacks.CallbackList(
        callbacks, add_history=history, add_progbar=verbose != 0, model=model,
        verbose=verbose, **params,
    )


def for_this_process(callbacks):
    """`callbacks` as a process other than 0 runs them: without `FILE_WRITERS`.

    As orbax writes from the primary host and `keras-dp train` saves on
    process 0, only process 0 writes the files; the others skip those
    callbacks (they see the same logs, so nothing else depends on them),
    except that a `BackupAndRestore` still restores its backup in
    `on_train_begin` on every process, so that all resume at one epoch.
    A callback that reads the model also syncs it, which is collective when
    the state is split across processes: the caller then keeps them on
    every process (`primary_writes=False`), as before, writing the same
    paths unless each process names its own.
    """
    kept = []
    for callback in keras.tree.flatten(callbacks or []):
        if isinstance(callback, keras.callbacks.BackupAndRestore):
            kept.append(_RestoreOnly(callback))
        elif not isinstance(callback, FILE_WRITERS):
            kept.append(callback)
    return kept


def restores(callbacks):
    """Whether a `CallbackList` holds a `BackupAndRestore` (or its `_RestoreOnly`)."""
    return any(isinstance(callback, (keras.callbacks.BackupAndRestore, _RestoreOnly))
               for callback in callbacks.callbacks)


class _RestoreOnly(keras.callbacks.Callback):
    """A `BackupAndRestore` that restores in `on_train_begin` and writes nothing."""

    def __init__(self, backup):
        super().__init__()
        self._backup = backup

    def set_model(self, model):
        super().set_model(model)
        self._backup.set_model(model)

    def set_params(self, params):
        super().set_params(params)
        self._backup.set_params(params)

    def on_train_begin(self, logs=None):
        self._backup.on_train_begin(logs)


def check_callbacks(callbacks):
    """Raise a `TypeError` naming the item unless each of `callbacks` is a Keras `Callback`.

    Keras fails later on such an item, with "'str' object has no attribute
    'on_batch_end'".
    """
    for index, callback in enumerate(keras.tree.flatten(callbacks or [])):
        if not isinstance(callback, keras.callbacks.Callback):
            raise TypeError(
                "`callbacks` takes keras.callbacks.Callback objects, such as "
                "keras.callbacks.EarlyStopping(patience=2). Received at index "
                f"{index}: {callback!r} (of type {type(callback).__name__})."
            )


def to_python(logs, model, metrics=None, step="train_step"):
    """Logs as python floats (arrays for non-scalar metrics), in Keras's order.

    As `model.fit` reports them: when the logs' names are exactly the
    model's metrics' (`_compat.metric_names`), in the order of
    `model.metrics`; otherwise (a custom step's own logs) sorted by name,
    as a jitted step returns a dict.

    `metrics` are the metric values the last step left. When the model
    overrides `step` (`"train_step"` or `"test_step"`) and its logs bear its
    metrics' names, the metrics' own results are reported, as Keras's fit
    and evaluate do (`Trainer._get_metrics_result_or_logs`): such a step
    may log other values under those names (a batch's loss where its
    tracker holds the running mean, or a tracker it never updates).
    """
    host = jax.device_get(logs)
    order = _compat.metric_names(model)
    names = order if set(order) == set(host) and len(order) == len(host) else sorted(host)
    if names is order and metrics is not None and _compat.custom_step(model, step):
        host = _metric_results(model, metrics)
    return {name: host[name].item() if np.ndim(host[name]) == 0 else np.asarray(host[name])
            for name in names}


def _metric_results(model, metrics):
    """`model.get_metrics_result()` with its metric variables holding `metrics`."""
    values = [np.asarray(mesh_lib.local_copy(value)) for value in metrics]
    with keras.StatelessScope(state_mapping=list(zip(model.metrics_variables, values))):
        return jax.device_get(model.get_metrics_result())


def in_evaluate_order(logs, model):
    """The list `model.evaluate` returns: the model's metrics in order, then
    any other logs by name; a single value alone."""
    order = _compat.metric_names(model)
    names = [name for name in order if name in logs]
    names += sorted(name for name in logs if name not in names)
    values = [logs[name] for name in names]
    return values[0] if len(values) == 1 else values


def check_validation_freq(validation_freq):
    """Raise a `ValueError` unless `validation_freq` is an int >= 1 or a list."""
    if isinstance(validation_freq, bool) or not isinstance(validation_freq, (int, list, tuple)):
        raise ValueError(
            "`validation_freq` is an int (validate every that many epochs) or "
            f"a list of 1-based epochs. Received: {validation_freq!r}."
        )
    if isinstance(validation_freq, int) and validation_freq < 1:
        raise ValueError(f"`validation_freq` must be at least 1. Received: {validation_freq}.")


def should_validate(epoch, validation_freq):
    """Keras's rule: `validation_freq` counts epochs from 1."""
    if isinstance(validation_freq, int):
        return (epoch + 1) % validation_freq == 0
    return epoch + 1 in validation_freq
