"""The sharded trainer: one Keras model, one `"batch"` mesh, compiled steps.

`ShardedTrainer` ties the other modules together. Its parts are public so a
user can run training by hand (`init_state`, `shard`, `train_step`,
`write_back`), and `fit`, `evaluate` and `predict` run them the way
`model.fit`, `model.evaluate` and `model.predict` do, with Keras's callbacks
and progress bar.

The Keras model is the record of truth between calls; during `fit`, the
replicated device state is, and the model is updated from it at the end of
every epoch and whenever `fit` exits, by an exception or an interrupt too.
"""

import collections
import contextlib

import jax
import keras
import numpy as np
# Keras's own helpers, so that builds and logs match model.fit exactly.
from keras.src import backend as keras_backend

from keras_dp import data as data_lib
from keras_dp import describe as describe_lib
from keras_dp import distributed as distributed_lib
from keras_dp import mesh as mesh_lib
from keras_dp import step as step_lib
from keras_dp.state import TrainState
from keras_dp.state import fresh_metrics
from keras_dp.state import is_alive
from keras_dp.state import model_weights
from keras_dp.state import write_back


class ShardedTrainer:
    """Synchronous data-parallel training of a Keras model over a JAX mesh.

    Args:
        model: a `keras.Model` (Sequential, Functional or subclassed). It
            may be unbuilt; it is built from the first batch, as in
            `model.fit`.
        optimizer, loss, metrics: as in `model.compile`; each one given
            overrides what the model was compiled with. An uncompiled model
            needs at least `optimizer` and `loss`.
        mesh: a 1-D `jax.sharding.Mesh` with axis `"batch"`.
        devices: the devices to train on (default: all of JAX's devices).
            Use either `mesh` or `devices`.
        seed: seed of the per-epoch shuffle of array data.
        steps_per_execution: optimizer steps per compiled call (default:
            the model's `steps_per_execution` from `compile`, else 1). K
            batches of equal size are stacked and sent at once, and one
            program runs K steps, each exactly a single step; batches left
            over at an epoch's end run one by one. Callbacks and the
            progress bar are called once per call, as in `model.fit`.
        unroll: how many of the K steps to unroll per loop iteration of
            the compiled scan (default: all of them on CPU, where XLA runs
            a rolled loop of this kind slower; 1 elsewhere).
        prefetch: how many batches (or stacks of K) a background thread
            prepares and copies to the devices ahead of the step that needs
            them; 0 prepares each in line.
        steps_in_flight: at most this many dispatched steps may be unfinished
            before the next is dispatched. Defaults to 1 on CPU (several
            queued cross-device all-reduces can deadlock XLA:CPU's thread
            pool) and 2 elsewhere.

    Raises:
        TypeError: `model` is not a `keras.Model`.
        ValueError: the model cannot be compiled from what was given, or
            the mesh is not a 1-D `"batch"` mesh.
    """

    def __init__(self, model, optimizer=None, loss=None, metrics=None, mesh=None,
                 devices=None, seed=0, steps_per_execution=None, unroll=None,
                 prefetch=2, steps_in_flight=None):
        if not isinstance(model, keras.Model):
            raise TypeError(
                "keras_dp trains a keras.Model. Received an object of type "
                f"{type(model).__module__}.{type(model).__qualname__}. Wrap "
                "layers in keras.Sequential([...]) or keras.Model(inputs, "
                "outputs)."
            )
        _compile(model, optimizer, loss, metrics)
        self.model = model
        self.mesh = mesh_lib.make_mesh(devices, mesh)
        self.seed = seed
        on_cpu = self.mesh.devices.flat[0].platform == "cpu"
        self.steps_in_flight = steps_in_flight or (1 if on_cpu else 2)
        self.prefetch = prefetch
        if steps_per_execution is None:
            steps_per_execution = getattr(model, "steps_per_execution", None) or 1
        self.steps_per_execution = int(steps_per_execution)
        if self.steps_per_execution < 1:
            raise ValueError(
                "`steps_per_execution` must be at least 1. Received: "
                f"{steps_per_execution}."
            )
        self.multiprocess = mesh_lib.spans_processes(self.mesh)
        if self.multiprocess:
            distributed_lib.block_order(self.mesh)  # a mesh it can use, or raise
            if self.steps_per_execution > 1:
                raise ValueError(
                    "`steps_per_execution` > 1 is not supported across "
                    "processes yet: the processes' row counts are exchanged "
                    "before every step. Received: steps_per_execution="
                    f"{steps_per_execution} on a mesh over "
                    f"{jax.process_count()} processes. Use 1 (the default)."
                )
            # The row-count exchange is a collective; a look-ahead thread
            # would interleave it with the steps in a different order on
            # each process.
            self.prefetch = 0
        if unroll is None:
            unroll = self.steps_per_execution if on_cpu else 1
        self._train_step = step_lib.make_train_step(model, self.mesh)
        self._train_steps = step_lib.make_multi_train_step(model, self.mesh, unroll)
        self._test_step = step_lib.make_test_step(model, self.mesh)
        self._predict_step = step_lib.make_predict_step(model, self.mesh)

    @property
    def num_devices(self):
        """The number of devices each global batch is split over."""
        return mesh_lib.num_devices(self.mesh)

    # -- The parts, for training by hand ------------------------------------

    def build(self, batch):
        """Build the model, its loss, metrics and optimizer from a host batch.

        A batch without labels builds the model's layers only (enough to
        predict).

        Also checks, before anything is compiled, that the labels fit the
        model's output under its loss.

        Raises:
            ValueError: the model cannot be built on `x`, or the labels do
                not fit its output.
        """
        _build(self.model, data_lib.unpack(batch))

    def init_state(self):
        """Return the model's current variables as a replicated `TrainState`.

        Raises:
            ValueError: the model, its metrics or optimizer are not built.
        """
        if not _is_built(self.model):
            raise ValueError(
                "The model is not built, so it has no variables to train. "
                "Call trainer.build(batch) with one batch of data first (fit "
                "does this for you), or model.build(input_shape)."
            )
        return TrainState.from_model(self.model, self.mesh)

    def shard(self, batch):
        """Put a host batch `(x, y[, sample_weight])` on the mesh, split by rows.

        Across processes, `batch` is this process's part of the global batch,
        and every process must call `shard` for the same step (it exchanges
        the row counts).
        """
        batch = data_lib.unpack(batch)
        if self.multiprocess:
            counts = distributed_lib.exchange_rows(data_lib.batch_rows(batch))
            return distributed_lib.to_global(batch, self.mesh, counts)
        return data_lib.to_device(batch, self.mesh)

    def train_step(self, state, batch):
        """Run one compiled step on a sharded batch: `(state, logs)`.

        `state` is donated: use the returned state, never the old one.
        """
        return self._train_step(state, batch)

    def write_back(self, state):
        """Copy `state` into the Keras model's variables."""
        write_back(state, self.model)

    def compiled_train_step(self, state, batch):
        """The train step compiled for these arguments (`.as_text()` is HLO)."""
        return self._train_step.lower(state, batch).compile()

    def describe(self, batch=None):
        """Describe the mesh, each state group's sharding and a batch's.

        Args:
            batch: an optional host batch; its placement is shown per device.

        Returns:
            A multi-line string.
        """
        state = self.init_state() if _is_built(self.model) else None
        device_batch = None if batch is None else self.shard(batch)
        return describe_lib.describe(self.mesh, state, device_batch)

    # -- The Keras-shaped loops ----------------------------------------------

    def fit(self, x=None, y=None, *, batch_size=None, epochs=1, verbose="auto",
            callbacks=None, validation_split=0.0, validation_data=None,
            shuffle=True, class_weight=None, sample_weight=None,
            initial_epoch=0, steps_per_epoch=None, validation_freq=1):
        """Train for `epochs` epochs, as `model.fit` does, on every device.

        Every row is used exactly once per epoch, whatever `batch_size` and
        the device count; each step equals one single-device step on the
        same rows.

        Args:
            x, y, sample_weight, batch_size: the training data (see
                `keras_dp.data.make_batches`); `batch_size` is global and
                need not divide by the device count.
            epochs: the index of the last epoch, as in `model.fit`: training
                runs epochs `initial_epoch` to `epochs - 1`.
            verbose: 0 silent, 1 progress bar, 2 one line per epoch.
            callbacks: Keras callbacks; they see the same hooks and logs as
                under `model.fit`. The model's weights are current at epoch
                boundaries.
            validation_split: hold out this last fraction of array data
                (taken before shuffling) and score it after each epoch.
            validation_data: `(x, y[, sample_weight])` or a dataset, scored
                after every epoch as `val_*` logs.
            shuffle: reshuffle array data every epoch, in an order fixed by
                the trainer's `seed` and the epoch index.
            class_weight: `{class_id: weight}`, applied as sample weights.
            initial_epoch: the epoch to start at (to resume a run); the
                shuffle order of epoch e is the same as in an unbroken run.
            steps_per_epoch: run this many steps per epoch, drawing batches
                from one continuing stream (for endless datasets). A
                re-iterable source restarts when it ends; a one-shot
                iterator that runs out stops training with a warning.
            validation_freq: validate every this many epochs (an int), or
                after the listed epochs (1-based, as in Keras).

        Returns:
            The `keras.callbacks.History` of the run.
        """
        if validation_split:
            if validation_data is not None:
                raise ValueError(
                    "Pass either `validation_data` or `validation_split`, not "
                    "both: keras_dp would not know which to score."
                )
            (x, y, sample_weight), validation_data = data_lib.split_validation(
                x, y, sample_weight, validation_split
            )
        batches = self._batches(x, y, sample_weight, batch_size, shuffle, class_weight)
        if steps_per_epoch is not None:
            batches = data_lib.StepsPerEpoch(batches, steps_per_epoch)
        self.build(batches.peek())
        val = None
        if validation_data is not None:
            val = self._batches(validation_data, None, None, batch_size, False)
            self.build(val.peek())  # bad validation labels fail now, not after epoch 1
        _check_validation_freq(validation_freq)
        callbacks = _callback_list(
            callbacks, self.model, verbose, epochs=epochs, steps=batches.steps
        )
        self.model.stop_training = False
        callbacks.on_train_begin()
        live = _Live()
        try:
            epoch_logs = {}
            for epoch in range(initial_epoch, epochs):
                validate = val is not None and _should_validate(epoch, validation_freq)
                epoch_logs = self._fit_epoch(
                    live, batches, epoch, callbacks, val if validate else None
                )
                if self.model.stop_training or getattr(batches, "exhausted", False):
                    break
            callbacks.on_train_end(epoch_logs)
        finally:
            live.write_back_if_alive(self.model)
        return self.model.history

    def evaluate(self, x=None, y=None, *, batch_size=None, verbose="auto",
                 sample_weight=None, callbacks=None, return_dict=False):
        """Return the loss and metrics over all rows, as `model.evaluate` does.

        Returns:
            The loss alone when there are no metrics, else a list in the
            order of `model.metrics_names`, or a dict with `return_dict`.
        """
        batches = self._batches(x, y, sample_weight, batch_size, False)
        self.build(batches.peek())
        callbacks = _callback_list(callbacks, self.model, verbose, steps=batches.steps)
        state = self.init_state()
        logs = self._evaluate(state, batches, callbacks)
        if return_dict:
            return logs
        values = list(logs.values())
        return values[0] if len(values) == 1 else values

    def predict(self, x, *, batch_size=None, verbose="auto", callbacks=None):
        """Return the model's outputs for every row of `x`, in order.

        Returns:
            Numpy arrays with the structure of the model's outputs and
            exactly one row per input row.
        """
        batches = self._batches(x, None, None, batch_size, False)
        self.build(batches.peek())
        callbacks = _callback_list(callbacks, self.model, verbose, steps=batches.steps)
        weights = model_weights(self.model, self.mesh)
        outputs = []
        callbacks.on_predict_begin()
        inputs = (batch[0] for batch in batches.epoch(0))
        for index, x_device in enumerate(self._placed(inputs, batches.peek()[0])):
            callbacks.on_predict_batch_begin(index)
            output = jax.tree.map(
                lambda out: self._local_rows(out, x_device),
                self._predict_step(weights, x_device),
            )
            outputs.append(output)
            callbacks.on_predict_batch_end(index, {"outputs": output})
        callbacks.on_predict_end()
        return jax.tree.map(lambda *parts: np.concatenate(parts), *outputs)

    # -- Internals -----------------------------------------------------------

    def _batches(self, x, y, sample_weight, batch_size, shuffle, class_weight=None):
        if self.multiprocess and batch_size is not None:
            # `batch_size` is global; each process slices its part of it.
            batch_size = distributed_lib.local_batch_size(batch_size, self.mesh)
        return data_lib.make_batches(
            x, y, sample_weight, batch_size=batch_size, shuffle=shuffle,
            seed=self.seed, class_weight=class_weight,
        )

    def _fit_epoch(self, live, batches, epoch, callbacks, val):
        """One epoch: sync in, train, sync out, validate. Returns epoch logs."""
        self.model.reset_metrics()
        callbacks.on_epoch_begin(epoch)
        # Read the model afresh: a callback may have changed it (weights,
        # learning rate) since the last write-back.
        live.state = self.init_state()
        throttle = _Throttle(self.steps_in_flight)
        logs = None
        if self.multiprocess:
            placed = ((1, batch) for batch in self._placed(batches.epoch(epoch), batches.peek()))
        else:
            groups = data_lib.group_steps(batches.epoch(epoch), self.steps_per_execution)
            placed = data_lib.prefetch(map(self._place, groups), self.prefetch)
        index = 0
        # Closing it on a break (stop_training) stops the look-ahead thread now.
        with contextlib.closing(placed):
            for steps, device_batch in placed:
                callbacks.on_train_batch_begin(index)
                step = self._train_step if steps == 1 else self._train_steps
                live.state, logs = step(live.state, device_batch)
                index += steps
                throttle.add(logs)
                callbacks.on_train_batch_end(index - 1, logs)
                if self.model.stop_training:
                    break
        throttle.drain()
        live.write_back_if_alive(self.model)
        # No logs: a one-shot stream ran dry at the epoch's start (fit stops).
        epoch_logs = {} if logs is None else _to_python(logs)
        if val is not None and logs is not None:
            val_logs = self._evaluate(live.state, val, callbacks)
            epoch_logs.update({f"val_{name}": value for name, value in val_logs.items()})
        live.state = None
        callbacks.on_epoch_end(epoch, epoch_logs)
        return epoch_logs

    def _placed(self, host_batches, template):
        """The `DeviceBatch` of each host batch; across processes, each global one.

        Across processes the loop runs until every process's share is out
        (`distributed.global_batches`), so it may run longer than this
        process's own batches; `template` is one of them, for padding.
        """
        if self.multiprocess:
            return distributed_lib.global_batches(host_batches, self.mesh, template)
        return data_lib.prefetch(
            (data_lib.to_device(batch, self.mesh) for batch in host_batches), self.prefetch
        )

    def _local_rows(self, output, batch):
        """This process's real rows of a batch-sharded output, as numpy."""
        if self.multiprocess:
            return distributed_lib.local_rows(output, batch, self.mesh)
        return np.asarray(output)[: batch.rows]

    def _place(self, group):
        """`(steps, DeviceBatch)` for a group of host batches from `group_steps`."""
        if len(group) == 1:
            return 1, self.shard(group[0])
        return len(group), data_lib.to_device_stacked(group, self.mesh)

    def _evaluate(self, state, batches, callbacks):
        """Score `batches` with `state`'s weights; returns python-float logs."""
        weights = (state.trainable, state.non_trainable)
        metrics = fresh_metrics(self.model, self.mesh)
        throttle = _Throttle(self.steps_in_flight)
        logs = None
        callbacks.on_test_begin()
        placed = self._placed(batches.epoch(0), batches.peek())
        for index, device_batch in enumerate(placed):
            callbacks.on_test_batch_begin(index)
            metrics, logs = self._test_step(weights, metrics, device_batch)
            throttle.add(logs)
            callbacks.on_test_batch_end(index, logs)
        throttle.drain()
        logs = _to_python(logs)
        callbacks.on_test_end(logs)
        return logs


class _Live:
    """The state of the epoch in progress, for write-back on any exit."""

    state = None

    def write_back_if_alive(self, model):
        # A step that failed after its state was donated leaves nothing to
        # write; the model then keeps the weights of the last epoch boundary.
        if self.state is not None and is_alive(self.state):
            write_back(self.state, model)


class _Throttle:
    """Bounds how many dispatched steps may still be running."""

    def __init__(self, limit):
        self._limit = limit
        self._pending = collections.deque()

    def add(self, outputs):
        self._pending.append(outputs)
        while len(self._pending) >= self._limit:
            jax.block_until_ready(self._pending.popleft())

    def drain(self):
        while self._pending:
            jax.block_until_ready(self._pending.popleft())


def _to_python(logs):
    """Logs as python floats (arrays for non-scalar metrics), in the order
    `model.evaluate` lists them: the loss first, then the rest by name."""
    host = jax.device_get(logs)
    names = sorted(host, key=lambda name: (name != "loss", name))
    return {name: host[name].item() if np.ndim(host[name]) == 0 else np.asarray(host[name])
            for name in names}


def _check_validation_freq(validation_freq):
    if isinstance(validation_freq, bool) or not isinstance(validation_freq, (int, list, tuple)):
        raise ValueError(
            "`validation_freq` is an int (validate every that many epochs) or "
            f"a list of 1-based epochs. Received: {validation_freq!r}."
        )
    if isinstance(validation_freq, int) and validation_freq < 1:
        raise ValueError(f"`validation_freq` must be at least 1. Received: {validation_freq}.")


def _should_validate(epoch, validation_freq):
    """Keras's rule: `validation_freq` counts epochs from 1."""
    if isinstance(validation_freq, int):
        return (epoch + 1) % validation_freq == 0
    return epoch + 1 in validation_freq


def _callback_list(callbacks, model, verbose, **params):
    if isinstance(callbacks, keras.callbacks.CallbackList):
        return callbacks
    verbose = 1 if verbose == "auto" else verbose
    if not distributed_lib.is_primary():
        verbose = 0  # one progress bar, on process 0, for all processes
    return keras.callbacks.CallbackList(
        callbacks, add_history=True, add_progbar=verbose != 0, model=model,
        verbose=verbose, **params,
    )


def _compile(model, optimizer, loss, metrics):
    overrides = {
        name: value
        for name, value in (("optimizer", optimizer), ("loss", loss), ("metrics", metrics))
        if value is not None
    }
    if not overrides and model.compiled:
        return
    # Keras keeps the arguments of the last compile() here; reusing them
    # changes only what the caller overrides.
    config = dict(model._compile_config.config) if model.compiled else {}
    config.update(overrides)
    if config.get("optimizer") is None or config.get("loss") is None:
        raise ValueError(
            "The model is not compiled, and keras_dp was not given both an "
            "optimizer and a loss. Either call model.compile(optimizer=..., "
            "loss=..., metrics=[...]) first, or pass optimizer= and loss= "
            f"(and metrics=). Received: optimizer={optimizer!r}, loss={loss!r}."
        )
    model.compile(**config)


def _is_built(model):
    parts = (model._compile_metrics, model._compile_loss)
    return (
        all(layer.built for layer in model._flatten_layers())
        and model.optimizer.built
        and all(part is None or part.built for part in parts)
    )


def _build(model, batch):
    """Build `model` symbolically from a host batch, checking the labels first."""
    x, y, sample_weight = jax.tree.map(_spec, batch)
    try:
        y_pred = keras_backend.compute_output_spec(model, x, training=False)
    except Exception as error:
        raise ValueError(
            "The model could not be built on the data's x (shapes "
            f"{jax.tree.map(lambda s: tuple(s.shape), x)}). Check that x matches "
            "the model's inputs, or build the model yourself with "
            f"model.build(input_shape). Keras reported: {error}"
        ) from error
    if y is None:
        return  # inputs only (predict): the symbolic call built every layer
    if model._compile_loss is not None:
        _check_labels(model, x, y, y_pred, sample_weight)
    model._symbolic_build(data_batch=batch)


def _check_labels(model, x, y, y_pred, sample_weight):
    try:
        keras_backend.compute_output_spec(
            model.compute_loss, x=x, y=y, y_pred=y_pred,
            sample_weight=sample_weight, training=False,
        )
    except Exception as error:
        shapes = lambda tree: jax.tree.map(lambda s: tuple(s.shape), tree)  # noqa: E731
        raise ValueError(
            f"The labels do not fit the model's output under its loss: y has "
            f"shape {shapes(y)}, the model outputs shape {shapes(y_pred)}, and "
            f"the loss is {model.loss!r}. Give labels in the form the loss "
            "expects: integer class ids of shape (batch,) for "
            "sparse_categorical_crossentropy, one-hot rows of shape (batch, "
            f"classes) for categorical_crossentropy. Keras reported: {error}"
        ) from error


def _spec(array):
    return keras.KerasTensor(np.shape(array), dtype=keras.backend.standardize_dtype(array.dtype))
