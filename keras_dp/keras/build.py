"""Building and compiling a Keras model from data, as `model.fit` does.

Keras builds an unbuilt model, its loss, metrics and optimizer from the
first batch; keras_dp does the same before anything is compiled for the
devices, and checks first that the labels fit the model's output, so that
a mistake fails with a message instead of deep inside a traced step.
"""

import inspect

import jax
import keras
import numpy as np

from keras_dp import _compat
from keras_dp.checks import errors as explain
from keras_dp.checks import labels
from keras_dp.checks import model as model_checks
from keras_dp.sources import inputs as pipeline


def compile_model(model, optimizer, loss, metrics):
    """Compile `model`, overriding only what is given (not None).

    A compiled model keeps its other compile arguments. An uncompiled model
    given nothing stays uncompiled (enough to predict; `require_compiled`
    refuses to train it), and one given an optimizer alone is compiled with
    it, as `model.compile(optimizer=...)` is for a model whose losses come
    from `add_loss`.

    Raises:
        ValueError: the model's own `compile` takes arguments Keras's does
            not (`model_checks.check_recompilable`).
    """
    overrides = {name: value for name, value in (
        ("optimizer", optimizer), ("loss", loss), ("metrics", metrics)) if value is not None}
    if not overrides:
        return
    model_checks.check_recompilable(model, overrides)
    # Recompile with the last compile()'s own objects, changing only what the
    # caller overrides (the public get_compile_config() serialises them, and
    # compiling from that would replace the user's optimizer and loss).
    config = _compat.compile_arguments(model) if model.compiled else {}
    config.update(overrides)
    model.compile(**config)


class Builder:
    """A trainer's side of its Keras model: `build` it from data, and the checks it needs.

    `build` skips data already checked against the same loss and optimizer
    (compared by identity): tracing a model symbolically costs as much as
    several steps of a small one. The other methods are the checks of
    `keras_dp.checks.model` and `keras_dp.checks.labels` on this model.
    """

    def __init__(self, model):
        model_checks.check_model(model)  # a keras.Model, with what keras_dp can train
        self.model = model
        self._checked = []  # (data signature, (loss, optimizer))
        self._unused_loss = None  # a compiled loss Keras's build found the model never calls

    def require_compiled(self, call):
        """Refuse to `call` ("fit", "evaluate") a model without an optimizer, naming the fix."""
        model_checks.require_compiled(self.model, call)

    def check_trainable_unchanged(self):
        """Refuse a layer's `trainable` changed since the optimizer was built, naming the fix."""
        model_checks.check_trainable_unchanged(self.model)

    def check_micro_batches(self, micro_batches):
        """Refuse micro-batches this model cannot be split into (`checks.model.check_micro_batches`)."""
        model_checks.check_micro_batches(self.model, micro_batches)

    def check_labels(self, *data):
        """Check the class-id labels of each `(source, what)` before any step (`labels.check_data`)."""
        labels.check_data(self.model, *data)

    def require_built(self, what):
        """Refuse to read the state of a model not built for training, naming the fix.

        `what` is the subject of the message ("The training state").
        """
        built = is_built(self.model, unused_loss=self._unused_loss)
        if not built and _compat.state_sync_shadowed(self.model):
            raise ValueError(
                "The model was compiled again during fit (a callback called "
                "model.compile): its new optimizer, loss and metrics are not built, "
                "and the fit's compiled step holds the old ones. Keras's model.fit "
                "fails on this too (\"'NoneType' object is not callable\"). Compile "
                "between fits instead: fit(..., epochs=k), then model.compile(...), "
                "then fit(..., initial_epoch=k, epochs=n)."
            )
        if not built:
            missing = ("its optimizer, loss or metrics are" if self.model.built
                       else "the model is")
            raise ValueError(
                f"{what} cannot be read yet: {missing} not built. Call "
                "trainer.build(batch) with one batch of data first (fit does this "
                "for you); it builds the layers, loss, metrics and optimizer, as "
                "model.fit does (model.build(input_shape) builds the layers only)."
            )

    def build(self, batch, for_training=True, data="the data"):
        """`build(self.model, batch, for_training, data)` unless already done for this data."""
        key = (signature(batch), for_training)
        parts = (_compat.compiled_loss(self.model), getattr(self.model, "optimizer", None))
        checked = any(key == seen and all(a is b for a, b in zip(parts, objects))
                      for seen, objects in self._checked)
        if checked and is_built(self.model, for_training, self._unused_loss):
            return
        with _compat.sharded_birth():  # a split variable never whole on one device
            build(self.model, batch, for_training, data)
        self._checked.append((key, parts))
        if for_training and parts[0] is not None and not parts[0].built:
            # Keras's build ran the model's compute_loss: one that never calls
            # the compiled loss leaves it unbuilt (as model.fit does), stateless.
            self._unused_loss = parts[0]


def is_built(model, for_training=True, unused_loss=None):
    """Whether the model is built, and for training its optimizer, loss and metrics.

    A layer the model never calls stays unbuilt, without weights, as under
    `model.fit`, as does `unused_loss`, a compiled loss that the model's
    `compute_loss` never calls: neither keeps the model from training.
    """
    if not model.built:
        return False
    if not for_training:
        return True
    parts = (_compat.compiled_metrics(model), _compat.compiled_loss(model))
    optimizer = getattr(model, "optimizer", None)  # absent before compile()
    return (
        optimizer is not None and optimizer.built
        and all(part is None or part.built or part is unused_loss for part in parts)
    )


def keras_reads_a_batch_to_build(model, for_training=True):
    """Whether Keras's own `fit` or `evaluate` (`for_training`), or `predict`, reads a batch to build first.

    They do while a layer is unbuilt, and `fit` and `evaluate` also while the
    compiled loss or metrics are (`Trainer._symbolic_build`); that batch
    comes from an iterator of its own, which draws a reshuffling tf.data
    pipeline's next order.
    """
    if not all(layer.built for layer in _compat.all_layers(model)):
        return True
    parts = (_compat.compiled_metrics(model), _compat.compiled_loss(model)) if for_training else ()
    return any(part is not None and not part.built for part in parts)


def build(model, batch, for_training=True, data="the data"):
    """Build `model` from a host batch as `model.fit` does, checking the labels first.

    The layers are built by tracing the model on the batch's `x` (again in
    training mode if a layer is still unbuilt: one called only when
    `training=True` is built, and trained, from the first step); a model
    without a `call()` (a GAN: sub-models and a custom `train_step`) must
    have built its sub-models itself, and is then marked built. For
    training (or evaluation), Keras's own symbolic build then builds the
    compiled loss, metrics and optimizer, with or without labels.

    Args:
        data: what the batch is from, for messages ("the validation data").

    Raises:
        ValueError: the model holds a TensorFlow-only layer
            (`model_checks.check_no_tensorflow_layers`) or a stateful RNN
            (`model_checks.check_no_stateful_rnn`), cannot be built on `x`, the
            labels are missing or do not fit its output, or its loss is not
            a scalar (`check_scalar_loss`).
    """
    model_checks.check_no_tensorflow_layers(model)  # an ensemble's members pass here only
    model_checks.check_no_stateful_rnn(model)
    x, y, sample_weight = jax.tree.map(spec, batch)
    if (for_training and y is None and _compat.compiled_loss(model) is not None
            and not _compat.custom_step(model, "train_step")):
        fix = ("give it labels, validation_data=(x_val, y_val) or (x, y) batches"
               if "validation" in data else "pass y (or (x, y) batches)")
        if isinstance(x, dict):  # a tf.data element of features and label, as TFDS gives
            fix += (f"; a batch that is a dict (keys {sorted(x)}) is all x, as in "
                    "model.fit: map it to a tuple, dataset.map(lambda d: (d['image'], "
                    "d['label']))")
        raise ValueError(
            f"The model is compiled with a loss ({_loss_name(model.loss)}), but {data} "
            f"has no labels: {fix}. A model whose losses all come from add_loss "
            "is compiled without one: model.compile(optimizer=...)."
        )
    if _compat.has_call(model):
        y_pred = _trace(model, x, data=data)
        if for_training:
            check_no_metric_updates_in_call(model, x)
            if not all(layer.built for layer in _compat.all_layers(model)):
                _trace(model, x, training=True, data=data)  # layers called only in training mode
            model_checks.check_metrics_per_output(model, y_pred)
            if y is not None and _compat.compiled_loss(model) is not None:
                # Labels only for training or evaluation: predict ignores y, as Keras.
                loss = check_labels(model, x, y, y_pred, sample_weight)
                if not _compat.custom_step(model, "train_step"):
                    check_scalar_loss(model, loss)
    else:
        _mark_built(model)
    if for_training:
        try:
            _compat.symbolic_build(model, batch)
        except Exception as error:
            explain.raise_untraceable(error, "The model's compiled loss or metrics")
            raise


def check_no_metric_updates_in_call(model, x):
    """Raise a `ValueError` naming the layer if `call()` updates a metric it holds.

    On JAX, Keras's steps run `call()` through `stateless_call`, which
    carries the weights and non-trainable variables out of the step, never
    the metrics': an `update_state` in a layer's `call()` is dropped, so the
    metric would be logged at its reset value, 0.0 (`model.fit` fails on it
    with "'NoneType' object is not callable"). The model is traced for
    this only when a layer inside it holds a metric.
    """
    holders = [layer for layer in _compat.all_layers(model)
               if not isinstance(layer, keras.Model) and layer.metrics]
    if not holders:
        return
    variables, updated = model.metrics_variables, []

    def call(x):
        with keras.StatelessScope() as scope:
            outputs = model(x, training=True)
        updated.extend(v for v in variables if scope.get_current_value(v) is not None)
        return outputs

    _compat.compute_output_spec(call, x)
    for layer in reversed(holders):  # the innermost layer holding the metric
        for metric in layer.metrics:
            if any(v is u for v in metric.variables for u in updated):
                raise ValueError(
                    f"Layer {layer.name!r} updates its metric {metric.name!r} in call(). "
                    "On JAX, Keras's steps carry only the weights out of call(), so the "
                    "update would be lost and the metric logged as 0.0 (model.fit fails "
                    "on it). Update the metric in the model's compute_metrics(x, y, "
                    "y_pred, sample_weight), which sees the inputs, or pass it to "
                    "compile(metrics=[...]).")


def _trace(model, x, training=False, data="the data"):
    """Trace `model` on `x`, building its layers; a failure names `data` and the fix.

    A model already built (with `keras.Input`, by `build()` or an earlier
    fit) is not built here, only called: a failure is `data`'s x not
    fitting it, and its message says so, not "could not be built" with a
    `model.build()` fix that does not apply. The Keras error is chained
    only when a frame of its traceback is the user's own code (a custom
    layer's `call()`); Keras's and JAX's frames alone are left out, as in
    `explain.shape_change`.
    """
    built = model.built
    try:
        return _compat.compute_output_spec(model, x, training=training)
    except Exception as error:
        explain.raise_untraceable(error, "The model")
        mode = " in training mode (training=True)" if training else ""
        shapes = jax.tree.map(lambda s: tuple(s.shape), x)
        user = explain.user_frames(error)
        where = (f" It was raised in your code ({user[-1].f_code.co_qualname}, line "
                 f"{user[-1].f_lineno} of {user[-1].f_code.co_filename}); its traceback "
                 "is chained above." if user else "")
        if built:
            refused = ValueError(
                f"The model, built{_input_shapes(model)}, fails on {data}'s x{mode} "
                f"(shapes {shapes}): {type(error).__name__}: {explain.first_line(error)}{where} "
                f"{'Fix it there, or, if x is not what the model takes, give' if user else 'Give'} "
                "x the shapes and structure of the model's inputs (with "
                "keras.Input, only dimensions given as None may vary)"
                f"{_one_sample_fix(model, x)}.")
        else:
            refused = ValueError(
                f"The model could not be built on {data}'s x{mode} (shapes {shapes}): "
                f"{type(error).__name__}: {explain.first_line(error)}{where} Check that x "
                "matches the model's inputs, or build the model yourself with "
                "model.build(input_shape).")
        raise refused from (error if user else None)


def _input_shapes(model):
    """`" for inputs of shape ..."` from a functional model's `keras.Input`s, else `""`."""
    shapes = [tuple(tensor.shape) for tensor in pipeline.functional_inputs(model)]
    if not shapes:
        return ""
    return (f" for inputs of shape {shapes[0]}" if len(shapes) == 1
            else f" for inputs of shapes {shapes}")


def _one_sample_fix(model, x):
    """`"; ..., x[None]"` when `x` is one array one dimension short of the model's one input."""
    inputs = pipeline.functional_inputs(model)
    if (len(inputs) == 1 and not isinstance(x, (dict, list, tuple))
            and len(x.shape) == len(inputs[0].shape) - 1):
        return (f"; x of shape {tuple(x.shape)} has no batch dimension: for one "
                "sample pass x[None], a batch of one")
    return ""


def _mark_built(model):
    """A model without `call()`: built once all its sub-layers are."""
    unbuilt = [layer.name for layer in _compat.all_layers(model)
               if layer is not model and not layer.built]
    if unbuilt:
        raise ValueError(
            f"{type(model).__name__} has no call() method, so it cannot be built "
            f"from data, and these layers are not built: {unbuilt}. Build its "
            "sub-models in its __init__ or build() (for example with "
            "keras.Input shapes), as model.fit requires too."
        )
    model.built = True


def check_scalar_loss(model, loss):
    """Raise a `ValueError` if `loss`, the spec of `model.compute_loss`, is not one number.

    Keras's step differentiates the loss; `jax.grad` of anything else fails
    inside the first compiled step (under `model.fit` as well) with "Gradient
    only defined for scalar-output functions".
    """
    if tuple(loss.shape) == ():
        return
    raise ValueError(
        f"The model's loss must be one number per batch, but its compute_loss "
        f"returns shape {tuple(loss.shape)} (loss: {_loss_name(model.loss)}). A "
        "keras.losses.Loss made with reduction=None returns one value per sample: "
        "use reduction='sum_over_batch_size' (Keras's default), 'mean' or 'sum', or "
        "reduce it to a scalar in your compute_loss."
    )


def check_labels(model, x, y, y_pred, sample_weight):
    """Raise a `ValueError` naming the shapes if `y` or `sample_weight` does not fit `y_pred` under the loss.

    Returns:
        The spec of the loss (`model.compute_loss`) on the batch.
    """
    # Called as Keras's steps call it: without `training` if it takes none.
    mode = ({"training": False} if "training" in inspect.signature(model.compute_loss).parameters
            else {})

    def loss_spec(weights):
        return _compat.compute_output_spec(
            model.compute_loss, x, y, y_pred, weights, **mode)

    try:
        return loss_spec(sample_weight)
    except Exception as error:
        explain.raise_untraceable(error, f"The loss, {_loss_name(model.loss)},")
        shapes = lambda tree: jax.tree.map(lambda s: tuple(s.shape), tree)  # noqa: E731
        if sample_weight is not None and _fits(loss_spec, None):
            fix = _weights_fix(model, loss_spec, y, y_pred, sample_weight)
            raise ValueError(
                f"The labels fit the model's output, but the sample weights (shape "
                f"{shapes(sample_weight)}) do not fit its loss (y has shape {shapes(y)}, "
                f"the model outputs shape {shapes(y_pred)}). {fix} Keras reported: "
                f"{explain.first_line(error)}"
            ) from None
        # Keras's traceback and error wrapping add nothing to this message.
        raise ValueError(
            f"The labels do not fit the model's output under its loss: y has "
            f"shape {shapes(y)}, the model outputs shape {shapes(y_pred)}, and "
            f"the loss is {_loss_name(model.loss)}. Give labels in the form the loss "
            "expects: integer class ids of shape (batch,) for "
            "sparse_categorical_crossentropy, one-hot rows of shape (batch, "
            f"classes) for categorical_crossentropy. Keras reported: {explain.first_line(error)}"
        ) from None


def _per_entry_loss(model, y, y_pred, sample_weight):
    """The shape of the unreduced loss, if one loss returns a value per entry of y; else None.

    Keras's losses reduce over the last axis, to one value per row (or per
    row and timestep), which a weight of that shape scales. A user's
    `keras.losses.Loss` or function that returns `y`'s own shape cannot take
    such a weight (Keras's fit fails on it too, on a broadcast).
    """
    loss = model.loss
    if isinstance(loss, (str, dict, list, tuple)) or not callable(loss):
        return None
    if not all(isinstance(tree, keras.KerasTensor) for tree in (y, y_pred, sample_weight)):
        return None
    try:
        values = _compat.compute_output_spec(
            loss.call if isinstance(loss, keras.losses.Loss) else loss, y, y_pred)
    except Exception:
        return None
    shape = tuple(getattr(values, "shape", ()))
    per_entry = len(shape) == len(y_pred.shape) and len(sample_weight.shape) < len(shape)
    return shape if per_entry else None


def _weights_fix(model, loss_spec, y, y_pred, sample_weight):
    """What to change when labels fit the loss but `sample_weight` does not."""
    per_entry = _per_entry_loss(model, y, y_pred, sample_weight)
    if per_entry:
        return (
            f"Its loss, {_loss_name(model.loss)}, returns one value per entry of y "
            f"(shape {per_entry}), and Keras weights one value per row (or per row "
            "and timestep): reduce it over the last axis in the loss, as Keras's own "
            "losses do, for example return keras.ops.mean(values, axis=-1).")
    class_weight = (
        "class_weight gives one weight per row, as in Keras's model.fit; for "
        "per-timestep labels pass sample_weight=np.vectorize(lambda c: "
        "class_weight.get(c, 1.0))(y) instead.")
    steps = _per_step_loss(loss_spec, y_pred, sample_weight)
    if steps:
        return (
            "The loss is per timestep, one value per row and step, and Keras takes no "
            "weights of one per row for it (its model.fit fails on a broadcast): "
            "repeat each row's weight over the steps, sample_weight=np.repeat("
            f"weights[:, None], {steps}, axis=1), of shape (rows, {steps}). {class_weight}")
    return ("Give one weight per row, or per row and timestep, (rows, steps), for a "
            f"per-timestep loss. {class_weight}")


def _per_step_loss(loss_spec, y_pred, sample_weight):
    """The step count, if `sample_weight` is one per row and the loss takes one per row and step; else None."""
    if not (isinstance(y_pred, keras.KerasTensor) and isinstance(sample_weight, keras.KerasTensor)
            and len(sample_weight.shape) == 1 and len(y_pred.shape) >= 3
            and isinstance(y_pred.shape[1], int)):
        return None
    per_step = keras.KerasTensor(tuple(y_pred.shape[:2]), sample_weight.dtype)
    return y_pred.shape[1] if _fits(loss_spec, per_step) else None


def _fits(loss_spec, sample_weight):
    """Whether `loss_spec(sample_weight)` traces."""
    try:
        loss_spec(sample_weight)
    except Exception:
        return False
    return True


def _loss_name(loss):
    """A loss as its name (`sparse_categorical_crossentropy`), not an object's repr."""
    if isinstance(loss, dict):
        return {key: _loss_name(value) for key, value in loss.items()}
    if isinstance(loss, (list, tuple)):
        return [_loss_name(value) for value in loss]
    return loss if isinstance(loss, str) else getattr(loss, "name", None) or getattr(
        loss, "__name__", type(loss).__name__)


def signature(batch):
    """A hashable summary of a host batch: its structure, shapes and dtypes."""
    leaves, treedef = jax.tree.flatten(batch)
    return treedef, tuple((np.shape(leaf), str(getattr(leaf, "dtype", type(leaf))))
                          for leaf in leaves)


def spec(array):
    """A `keras.KerasTensor` with the shape and dtype of `array`."""
    return keras.KerasTensor(np.shape(array), dtype=keras.backend.standardize_dtype(array.dtype))


def check_keras_distribution():
    """Refuse a Keras distribution whose layout an ensemble would ignore.

    An ensemble (`keras_dp.ensemble`) lays out every member's variables
    itself, each member whole on its devices. Under
    `keras.distribution.DataParallel` that is what Keras would do too; any
    other distribution (`ModelParallel`'s sharded variables) would be
    silently replaced, so it is refused: when an ensemble trainer is made,
    and again when it builds its members or runs a step by hand, since a
    distribution set after the trainer was made would lay out the variables
    the build creates and add its own layout constraints to the step's trace.
    (`ShardedTrainer` trains under one: `keras_dp.keras.layouts`.)

    Raises:
        ValueError: a distribution other than `DataParallel` is set.
    """
    current = keras.distribution.distribution()
    if current is not None and not isinstance(current, keras.distribution.DataParallel):
        raise ValueError(
            "Ensembles train with data parallelism only: each member whole on its "
            "devices, ignoring Keras layouts. "
            f"Received: a {type(current).__name__} distribution, set with "
            "keras.distribution.set_distribution() or entered with "
            "`with distribution.scope():`. Call fit_ensemble outside that scope, "
            "after keras.distribution.set_distribution(None) (a model created "
            "under it trains as well); or train one model under the distribution "
            "with keras_dp.fit_sharded(..., distribution=...)."
        )
