"""Keras's callbacks and logs, as `model.fit` hands them out.

`callback_list` makes the `keras.callbacks.CallbackList` `model.fit` would
(History, progress bar); the rest are Keras's rules for logs and for
`validation_freq`. The Keras model a callback reads is kept current by
`keras_dp.core.state.LiveModel`. Across processes, Keras's callbacks that
write files run on process 0 only (`for_this_process`), every process
taking part in their reads of a split state.
"""

import contextlib

import jax
import keras
import numpy as np

from keras_dp import _compat
from keras_dp import distributed as distributed_lib
from keras_dp import transfer

# Keras's callbacks that write files. Across processes every process would
# write the same paths at once (a CSV of interleaved rows, two TensorBoard
# event files per run, a checkpoint torn by two writers).
FILE_WRITERS = (keras.callbacks.ModelCheckpoint, keras.callbacks.CSVLogger,
                keras.callbacks.TensorBoard, keras.callbacks.BackupAndRestore)


def callback_list(callbacks, model, verbose, history=True, collective_reads=False, **params):
    """The `CallbackList` `model.fit` would make: History, and a progress bar
    unless `verbose` is 0 (on process 0 only, across processes).

    `history=False` for `evaluate` and `predict`: as under Keras, they add
    no History, so `model.history` stays the last fit's. `verbose` reaches
    the callbacks' `params` as given (`"auto"` too, as in `model.fit`).
    `collective_reads`: reading the model gathers a state split across
    processes (see `for_this_process`).
    """
    if isinstance(callbacks, keras.callbacks.CallbackList):
        return callbacks
    check_callbacks(callbacks)
    if not distributed_lib.is_primary():
        verbose = 0  # one progress bar, on process 0, for all processes
    if jax.process_count() > 1:
        callbacks = for_this_process(callbacks, collective_reads)
    return keras.callbacks.CallbackList(
        callbacks, add_history=history, add_progbar=verbose != 0, model=model,
        verbose=verbose, **params,
    )


# Keras's callbacks whose `verbose` only prints what they decide ("Epoch 3:
# early stopping", "ReduceLROnPlateau reducing learning rate to ...").
ANNOUNCERS = (keras.callbacks.EarlyStopping, keras.callbacks.ReduceLROnPlateau,
              keras.callbacks.LearningRateScheduler)


@contextlib.contextmanager
def announced_on_process_0(callbacks):
    """Run the block with the `CallbackList`'s `ANNOUNCERS` silent on processes other than 0.

    Every process runs them on the same logs and decides the same, so each
    printed the same message ("[process 1] Epoch 2: early stopping" under
    `keras-dp launch`), where the progress bar is process 0's alone. Their
    `verbose` is 0 during the block and given back after it, whatever ends it.
    """
    quiet = [] if distributed_lib.is_primary() else [
        (callback, callback.verbose) for callback in callbacks.callbacks
        if isinstance(callback, ANNOUNCERS) and callback.verbose]
    for callback, _ in quiet:
        callback.verbose = 0
    try:
        yield
    finally:
        for callback, verbose in quiet:
            callback.verbose = verbose


def beyond_logs(callbacks):
    """Whether a callback of the `CallbackList` may read the model, not only the logs.

    Every one but Keras's `History` and progress bar (`ProgbarLogger`) may,
    through `self.model` or a closure over the model (a `LambdaCallback`).
    """
    return any(not isinstance(callback, (keras.callbacks.History, keras.callbacks.ProgbarLogger))
               for callback in callbacks.callbacks)


@contextlib.contextmanager
def released_on_error(callbacks):
    """Shut down the `CallbackList`'s thread pool if the block raises; the exception goes on unchanged.

    Keras's `CallbackList` starts a pool in `on_*_begin` when every callback
    may run asynchronously (History and the progress bar do) and shuts it
    down only in `on_*_end`, which a failed pass never reaches: its worker
    thread would stay until the list is garbage collected.
    """
    try:
        yield
    except BaseException:
        _compat.shut_down_callback_pool(callbacks)
        raise


def for_this_process(callbacks, collective_reads=False):
    """`callbacks` as this process runs them: `FILE_WRITERS` on process 0 only.

    As orbax writes from the primary host and `keras-dp train` saves on
    process 0, only process 0 writes the files; the others skip those
    callbacks (they see the same logs, so nothing else depends on them),
    except that a `BackupAndRestore` still restores its backup in
    `on_train_begin` on every process, so that all resume at one epoch.

    With `collective_reads` (a state split across processes), the first
    read of the model after a step gathers the state, and every process
    must take part: each writer then keeps its place on every process as a
    `_ReadEverywhere`, at whose hooks every process reads the model before
    process 0 alone runs the writer.
    """
    primary = distributed_lib.is_primary()
    kept = []
    for callback in keras.tree.flatten(callbacks or []):
        if not isinstance(callback, FILE_WRITERS):
            kept.append(callback)
        elif collective_reads:
            kept.append(_ReadEverywhere(callback, primary))
        elif primary:
            kept.append(callback)
        elif isinstance(callback, keras.callbacks.BackupAndRestore):
            kept.append(_RestoreOnly(callback))
    return kept


def restores(callbacks):
    """Whether a `CallbackList` holds a `BackupAndRestore` (or its stand-in)."""
    return any(isinstance(getattr(callback, "callback", callback),
                          keras.callbacks.BackupAndRestore)
               for callback in callbacks.callbacks)


class _RestoreOnly(keras.callbacks.Callback):
    """A `BackupAndRestore` that restores in `on_train_begin` and writes nothing."""

    def __init__(self, backup):
        super().__init__()
        self.callback = backup

    def set_model(self, model):
        super().set_model(model)
        self.callback.set_model(model)

    def set_params(self, params):
        super().set_params(params)
        self.callback.set_params(params)

    def on_train_begin(self, logs=None):
        self.callback.on_train_begin(logs)


class _ReadEverywhere(keras.callbacks.Callback):
    """A file writer that process 0 alone runs, where reading the model is collective.

    Every process holds one at the writer's place. At each hook where the
    writer may read the model (Keras's code: every epoch's begin and end,
    `TensorBoard`'s validation end and first batch end, which writes the
    graph, and every batch end of an integer `save_freq`), every process
    reads it (`self.model`, which syncs the live state into it, gathering
    the split arrays); then process 0 runs the writer, whose own reads
    find the model in step and gather nothing. The other processes run
    nothing but a `BackupAndRestore`'s restore (`_RestoreOnly`).
    """

    def __init__(self, callback, primary):
        super().__init__()
        self.callback = callback
        restore = isinstance(callback, keras.callbacks.BackupAndRestore)
        self._runs = callback if primary else _RestoreOnly(callback) if restore else None
        self._every_batch = getattr(callback, "save_freq", "epoch") != "epoch"
        self._graph = False  # TensorBoard writes the train graph at the next batch end

    def set_model(self, model):
        super().set_model(model)
        self._graph = isinstance(self.callback, keras.callbacks.TensorBoard) and bool(
            self.callback.write_graph)
        self._run("set_model", model)

    def set_params(self, params):
        super().set_params(params)
        self._run("set_params", params)

    def _run(self, hook, *args, read=False):
        if read:
            self.model  # noqa: B018 - the read: every process syncs here, together
        if self._runs is not None:
            getattr(self._runs, hook)(*args)

    def on_train_begin(self, logs=None):
        self._run("on_train_begin", logs)

    def on_train_end(self, logs=None):
        self._run("on_train_end", logs)  # after fit wrote the state back

    def on_epoch_begin(self, epoch, logs=None):
        self._run("on_epoch_begin", epoch, logs, read=True)

    def on_epoch_end(self, epoch, logs=None):
        self._run("on_epoch_end", epoch, logs, read=True)

    def on_train_batch_begin(self, batch, logs=None):
        self._run("on_train_batch_begin", batch, logs)

    def on_train_batch_end(self, batch, logs=None):
        read, self._graph = self._every_batch or self._graph, False
        self._run("on_train_batch_end", batch, logs, read=read)

    def on_test_begin(self, logs=None):
        self._run("on_test_begin", logs)

    def on_test_end(self, logs=None):
        self._run("on_test_end", logs,
                  read=isinstance(self.callback, keras.callbacks.TensorBoard))

    def on_test_batch_begin(self, batch, logs=None):
        self._run("on_test_batch_begin", batch, logs)

    def on_test_batch_end(self, batch, logs=None):
        self._run("on_test_batch_end", batch, logs)


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
    return {name: value.item() if np.ndim(value) == 0 else np.asarray(value)
            for name, value in flatten_logs({name: host[name] for name in names}).items()}


def flatten_logs(logs):
    """`logs` with each dict entry replaced by its entries, as Keras's `pythonify_logs` does.

    A metric whose `result()` is a dict logs each of its entries under the
    entry's own name (sorted), not under the metric's, as `model.fit`
    reports it. Other entries keep their place and value.
    """
    flat = {}
    for name, value in logs.items():
        if isinstance(value, dict):
            flat.update(flatten_logs({key: value[key] for key in sorted(value)}))
        else:
            flat[name] = value
    return flat


def _metric_results(model, metrics):
    """`model.get_metrics_result()` with its metric variables holding `metrics`."""
    values = [np.asarray(transfer.local_copy(value)) for value in metrics]
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


