"""The compiled steps: pure functions of (state, batch), jitted over the mesh.

Each step sees the *global* batch as one sharded array, and the model state
as replicated arrays or split as `state_sharding` says (`keras_dp.layout`).
The batch arrives as a `DeviceBatch` padded to split evenly; the step first
cuts it back to its real rows (`placement.real_rows`), so that whatever the
batch size, the step computes exactly what one device would on those rows,
BatchNorm statistics, loss mean and metrics included. The loss is the mean
over the global batch, so its gradient with respect to the replicated
weights is a sum over every device's rows: XLA's SPMD partitioner computes
each device's partial gradient on its own shard and inserts one all-reduce
to combine them. Every device then applies the same averaged gradient to
the same weights, which is why the replicas never drift apart, and why a
step on N devices equals the same step on one device over the same rows
(up to float summation order).
"""

import inspect

import jax
import jax.numpy as jnp
import keras

from keras_dp import _compat
from keras_dp.core import finite
from keras_dp import layout
from keras_dp import sharding as mesh_lib
from keras_dp.core import placement
from keras_dp.core.state import TrainState


def make_train_step(model, mesh, *, state_sharding, donate):
    """Return the jitted `train_step(state, batch) -> (state, logs)`.

    The forward pass and loss are Keras's own stateless
    `model.compute_loss_and_updates` (`stateless_call` plus
    `stateless_compute_loss`, with regularisation losses and loss scaling);
    the update is `optimizer.stateless_apply`. A model that overrides
    `train_step` runs its own instead (`model_train_step`). `state` is
    donated (its buffers reused for the new state) unless `donate` is
    False; the new state comes back laid out as `state_sharding` says
    (`keras_dp.layout`), the logs replicated. Under `"optimizer"` and
    `"full"` the gradients are constrained to the split layout before the
    update, so each device updates its own slice (`keras_dp.layout` says
    which collectives XLA makes of that).

    A step whose running loss (`logs["loss"]`, the mean over the epoch so
    far) is NaN or Inf, or whose new trainable or optimizer values are (a
    finite loss with non-finite gradients: `sqrt` at 0), keeps the weights,
    non-trainable state and optimizer it was given (`finite.keep_if_not_finite`).
    The running loss then stays non-finite, so every later step of the
    epoch keeps them too: however many steps were dispatched before the
    host notices, the state still holds the last good weights.

    Args:
        model: a built, compiled Keras model; only read while tracing.
        mesh: the `"batch"` mesh.
        state_sharding: `"replicated"`, `"optimizer"` or `"full"`.
        donate: consume `state` (False keeps it valid: `keep_last_good`).
    """
    return jax.jit(sharded_train_step(model, mesh, state_sharding),
                   donate_argnums=donated(donate))


def check_device_batch(batch, caller="trainer.train_step"):
    """Refuse a batch that is not on the mesh yet, naming the fix.

    Raises:
        TypeError: `batch` is not a `placement.DeviceBatch`.
    """
    if not isinstance(batch, placement.DeviceBatch):
        raise TypeError(
            f"{caller} takes a batch placed on the mesh (a keras_dp DeviceBatch). "
            f"Received: batch of type {type(batch).__name__}. Place it first: "
            f"{caller}(state, trainer.shard(batch)).")


def donated(donate):
    """`donate_argnums` of a train program: its state (argument 0), or nothing."""
    return 0 if donate else ()


def make_multi_train_step(model, mesh, *, unroll, state_sharding, donate):
    """Return the jitted `train_steps(state, batches) -> (state, logs, finite)`.

    `batches` is a stacked `DeviceBatch` (`placement.to_device_stacked`): K
    batches of the same row count, shape `[K, rows, ...]`, sharded
    `PartitionSpec(None, "batch")`. The program runs K optimizer steps, each
    exactly the step of `make_train_step` (its own gradient all-reduce), as
    a `lax.scan` carrying the state; `unroll` steps are unrolled per loop
    iteration (`unroll=K` unrolls fully, which XLA:CPU runs faster). The
    logs are those after the last step, as Keras reports them under
    `steps_per_execution`: the metrics' running values over the epoch so far.
    The third output counts the steps whose loss was finite (K unless one
    failed; see `make_train_step` for what a non-finite loss does). `state`
    is donated unless `donate` is False.
    """
    step = sharded_train_step(model, mesh, state_sharding)

    def train_steps(state, batches):
        return scan_train_steps(step, state, batches, unroll, mesh)

    return jax.jit(train_steps, donate_argnums=donated(donate))


def scan_train_steps(step, state, batches, unroll, mesh):
    """Inside a compiled program: `step` scanned over a stack, `(state, logs, finite)`.

    `batches` is any pytree whose leaves have a leading axis of K (a stacked
    `DeviceBatch`, or what a caller's `step` turns into one); `step(state,
    batch)` is a `sharded_train_step`. Returns the last state, the logs of
    the last step, and the number of steps whose loss was finite
    (replicated over `mesh`).
    """
    state, logs = jax.lax.scan(step, state, batches, unroll=unroll)
    steps = jax.tree.leaves(batches)[0].shape[0]
    # Without a loss there is nothing to check: every step counts as finite.
    count = finite.finite_steps(logs["loss"], steps) if "loss" in logs else steps
    last = jax.tree.map(lambda values: values[-1], logs)
    return state, last, _replicated(jnp.asarray(count), mesh)


def sharded_train_step(model, mesh, state_sharding):
    """The unjitted `step(state, batch) -> (state, logs)` every train program runs.

    `batch` is a `DeviceBatch`; the step cuts it to its real rows, runs
    `model_train_step` on them, keeps the old weights if the loss is not
    finite (see `make_train_step`), and lays the state out as
    `state_sharding` says, both the state it is given and the new one, so
    that the K steps of a scan partition as the single step does. Shared by
    the single- and multi-step programs and by `keras_dp.core.feed`'s.
    """
    step = model_train_step(model, lambda grads: layout.constrain(
        grads, layout.gradient_shardings(grads, mesh, state_sharding)))

    def train_step(state, batch):
        # The state's layout pinned on the way in too: inside a rolled scan
        # the state is a while loop's carry, whose layout XLA otherwise infers,
        # and a split state then gave the weights their slots' split, so the
        # forward ran column-split, summing in another order than the single
        # step (free here: the single step's arguments already lie so).
        state = layout.constrain(state, layout.state_shardings(state, mesh, state_sharding))
        new_state, logs = step(state, placement.real_rows(batch, mesh))
        new_state, logs = finite.keep_if_not_finite(new_state, state, logs,
                                                    join=state_sharding == "replicated")
        shardings = layout.state_shardings(new_state, mesh, state_sharding)
        return layout.constrain(new_state, shardings), _replicated(logs, mesh)

    return train_step


def _replicated(tree, mesh):
    return jax.lax.with_sharding_constraint(tree, mesh_lib.replicated(mesh))


def model_train_step(model, constrain_grads=None):
    """The pure optimizer step of `model` on a batch `(x, y, sample_weight)`.

    `constrain_grads`, if given, is applied to the gradients before the
    update (see `make_train_step`); a model's own `train_step` computes its
    gradients itself, so there only the new state's layout is constrained.

    The model's own stateless `train_step(state, data)` when it overrides
    Keras's (a GAN, a VAE: see `keras_dp._compat.custom_step`), called as
    `model.fit` calls it on the JAX backend: `state` is the tuple
    `(trainable, non_trainable, optimizer, metrics)` of `TrainState`, and
    `data` is `keras.utils.pack_x_y_sample_weight(x, y, sample_weight)`, the
    form Keras gives it for array input. Otherwise Keras's default step.

    Unjitted and unaware of devices: `make_train_step` runs it on the real
    rows of a sharded batch, and the ensemble vmaps it over its members.
    """
    if _compat.custom_step(model, "train_step"):
        def custom_train_step(state, batch):
            logs, new_state = model.train_step(tuple(state), _keras_data(batch))
            return _custom_state(model, new_state), logs

        return custom_train_step

    def train_step(state, batch):
        x, y, sample_weight = batch
        grad_fn = jax.value_and_grad(model.compute_loss_and_updates, has_aux=True)
        (_, aux), grads = grad_fn(
            state.trainable,
            state.non_trainable,
            state.metrics,
            x,
            y,
            sample_weight,
            training=True,
            optimizer_variables=state.optimizer,
        )
        loss, y_pred, non_trainable, metrics = aux
        if constrain_grads is not None:
            grads = constrain_grads(grads)
        trainable, optimizer = model.optimizer.stateless_apply(
            state.optimizer, grads, state.trainable
        )
        metrics, logs = _update_metrics(
            model, metrics, loss, x, y, y_pred, sample_weight
        )
        return TrainState(trainable, non_trainable, optimizer, metrics), logs

    return train_step


def make_test_step(model, mesh, *, state_sharding):
    """Return the jitted `test_step(weights, metrics, batch) -> (non_trainable, metrics, logs)`.

    `weights` is the `(trainable, non_trainable)` pair, read but not
    donated (inference mode: BatchNorm uses its moving statistics, Dropout
    is off). The non-trainable values come back as the step leaves them, as
    `model.evaluate` keeps them (a layer may advance its seed generator even
    in inference mode). `metrics` is donated and returned updated with this
    batch. A model that overrides `test_step` has it called as
    `model.evaluate` calls it: `model.test_step((trainable, non_trainable,
    metrics), data)`.
    """
    return jax.jit(_test_step(model, mesh, state_sharding), donate_argnums=1)


def make_multi_test_step(model, mesh, *, unroll, state_sharding):
    """Return the jitted `test_steps(weights, metrics, batches) -> (non_trainable, metrics, logs)`.

    K test steps in one program, each exactly the step of `make_test_step`:
    a `lax.scan` over a stacked `DeviceBatch` (as in `make_multi_train_step`)
    carrying the non-trainable values and the metrics; the trainable
    weights are read, never donated. The logs are those after the last step.
    """
    step = _test_step(model, mesh, state_sharding)

    def test_steps(weights, metrics, batches):
        trainable, non_trainable = weights

        def body(carry, batch):
            non_trainable, metrics, logs = step((trainable, carry[0]), carry[1], batch)
            return (non_trainable, metrics), logs

        (non_trainable, metrics), logs = jax.lax.scan(
            body, (non_trainable, metrics), batches, unroll=unroll)
        return non_trainable, metrics, jax.tree.map(lambda values: values[-1], logs)

    return jax.jit(test_steps, donate_argnums=1)


def _custom_state(model, new_state):
    """The state a model's own `train_step` returned, as a `TrainState`.

    Raises:
        TypeError: it is not the 4 groups of variables the step was given.
    """
    if isinstance(new_state, (tuple, list)) and len(new_state) == 4:
        return TrainState(*new_state)
    got = (f"{len(new_state)} items" if isinstance(new_state, (tuple, list))
           else type(new_state).__name__)
    raise TypeError(
        f"{type(model).__name__}.train_step returned a state of {got}. On JAX it must "
        "return (logs, state), with state the 4 groups it was given, updated: "
        "(trainable_variables, non_trainable_variables, optimizer_variables, "
        "metrics_variables).")


def _test_step(model, mesh, state_sharding):
    """The unjitted sharded test step shared by the single- and multi-step programs.

    The non-trainable values and metrics come back laid out as
    `state_sharding` says, the logs replicated.
    """
    custom = _compat.custom_step(model, "test_step")

    def test_step(weights, metrics, batch):
        x, y, sample_weight = placement.real_rows(batch, mesh)
        trainable, non_trainable = weights
        logs, _, non_trainable, metrics = keras_test_step(
            model, custom, trainable, non_trainable, metrics, x, y, sample_weight)
        non_trainable = layout.constrain(non_trainable, layout.group_shardings(
            non_trainable, mesh, state_sharding, "non_trainable"))
        metrics = layout.constrain(
            metrics, layout.group_shardings(metrics, mesh, state_sharding, "metrics"))
        return non_trainable, metrics, _replicated(logs, mesh)

    return test_step


def make_predict_step(model, mesh, *, state_sharding):
    """Return the jitted `predict_step(weights, batch) -> (y_pred, non_trainable)`.

    `batch` is a `DeviceBatch` of inputs. `y_pred` has as many rows as the
    batch has padded rows, split over `"batch"` like the input: row i of
    the output is row i of the input, and padding rows (past `batch.rows`,
    or past each process block's real rows) are zeros (the model never sees
    the padding). The non-trainable values come back as the step leaves
    them, laid out as `state_sharding` says: `model.predict` carries them
    from batch to batch and keeps them, so a layer that draws random
    numbers in inference mode (a `SeedGenerator`) draws new ones each batch.
    """
    return jax.jit(_predict_step(model, mesh, state_sharding))


def make_multi_predict_step(model, mesh, *, unroll, state_sharding):
    """Return the jitted `predict_steps(weights, batches) -> (y_pred, non_trainable)`.

    K predict steps in one program over a stacked `DeviceBatch`, each
    exactly the step of `make_predict_step`, carrying the non-trainable
    values from step to step: every output has shape `[K, padded_rows,
    ...]`, sharded `PartitionSpec(None, "batch")` like the input, step k's
    rows at index k; the non-trainable values are those the last step left.
    """
    step = _predict_step(model, mesh, state_sharding)

    def predict_steps(weights, batches):
        trainable, non_trainable = weights

        def body(non_trainable, batch):
            y_pred, non_trainable = step((trainable, non_trainable), batch)
            return non_trainable, y_pred

        non_trainable, outputs = jax.lax.scan(body, non_trainable, batches, unroll=unroll)
        stacked = mesh_lib.stacked_batch_sharded(mesh)
        return jax.lax.with_sharding_constraint(outputs, stacked), non_trainable

    return jax.jit(predict_steps)


def _predict_step(model, mesh, state_sharding):
    """The unjitted sharded predict step shared by the single- and multi-step programs."""
    custom = _compat.custom_step(model, "predict_step")

    def predict_step(weights, batch):
        trainable, non_trainable = weights
        x = placement.real_rows(batch, mesh)
        if custom:  # called as model.predict calls it
            y_pred, non_trainable = model.predict_step((trainable, non_trainable),
                                                       _keras_data((x,)))
        else:
            y_pred, non_trainable = model.stateless_call(trainable, non_trainable, x,
                                                         **inference_kwargs(model))
        y_pred = jax.tree.map(
            lambda out: jax.lax.with_sharding_constraint(
                placement.restore_rows(out, batch), mesh_lib.batch_sharded(mesh)
            ),
            y_pred,
        )
        return y_pred, layout.constrain(non_trainable, layout.group_shardings(
            non_trainable, mesh, state_sharding, "non_trainable"))

    return predict_step


def inference_kwargs(model):
    """`{"training": False}` when `model.call` takes `training`, else `{}`.

    `stateless_call` passes its keywords to `call` as they are; Keras's own
    predict step passes `training` only to a `call` that declares it, and
    so does this (a subclassed model may define `call(self, x)`).
    """
    return {"training": False} if "training" in inspect.signature(model.call).parameters else {}


def keras_test_step(model, custom, trainable, non_trainable, metrics, x, y, sample_weight):
    """One test step as Keras runs it, statelessly: the model's own `test_step` if `custom`.

    Returns:
        `(logs, y_pred, non_trainable, metrics)`; `y_pred` is None after a
        custom `test_step`, which does not return its predictions.
    """
    if custom:
        logs, (_, non_trainable, metrics) = model.test_step(
            (trainable, non_trainable, metrics), _keras_data((x, y, sample_weight)))
        return logs, None, non_trainable, metrics
    _, (loss, y_pred, non_trainable, metrics) = model.compute_loss_and_updates(
        trainable, non_trainable, metrics, x, y, sample_weight, training=False)
    metrics, logs = _update_metrics(model, metrics, loss, x, y, y_pred, sample_weight)
    return logs, y_pred, non_trainable, metrics


def _keras_data(batch):
    """`(x, y, sample_weight)` in the form Keras hands a step: `x` alone without labels."""
    return keras.utils.pack_x_y_sample_weight(*(tuple(batch) + (None,) * (3 - len(batch))))


def _update_metrics(model, metrics, loss, x, y, y_pred, sample_weight):
    """Update the loss tracker and compiled metrics statelessly.

    Returns:
        `(metrics, logs)`: the new metric variable values, in the order of
        `model.metrics_variables`, and the running results as a dict.
    """
    variables = model.metrics_variables
    with keras.StatelessScope(state_mapping=list(zip(variables, metrics))) as scope:
        rows = jax.tree.leaves(x)[0].shape[0]
        # Keras keeps the running loss in this private Mean; updating it as
        # model.fit does keeps `logs["loss"]` identical to Keras's.
        _compat.loss_tracker(model).update_state(loss, sample_weight=rows)
        logs = model.compute_metrics(x, y, y_pred, sample_weight)
    updated = [scope.get_current_value(variable) for variable in variables]
    metrics = [new if new is not None else old for new, old in zip(updated, metrics)]
    return metrics, logs
