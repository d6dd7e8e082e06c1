"""Checking class-id labels before they are trained on.

A sparse categorical loss reads each label as a class id: Keras casts it
to an integer and looks it up in the model's output, with no check. A NaN
label, an id equal to the class count, a negative id or a fractional float
then trains with a finite loss (under `model.fit` too), and the run is
silently wrong. `label_check` makes a checker for a model whose compiled
loss is Keras's sparse categorical crossentropy; array data is checked once
on the host before the first step, a dataset batch by batch as it arrives
(`pipeline` calls the checker). Other losses are not checked: one-hot rows,
float targets and custom losses are the user's to define.
"""

import jax
import jax.numpy as jnp
import keras
import numpy as np

from keras_dp import _compat
from keras_dp.checks.data import is_real


def label_check(model, x):
    """A `check(y, where)` for `model`'s labels, or None if no output has a sparse loss.

    `check` raises a `ValueError` naming the first bad label, its row and
    `where` ("The labels", "Batch 3 of epoch 1"): a NaN or Inf, a
    fractional float, or an id outside `[0, classes)` (the loss's
    `ignore_class` is allowed). `x` is a host batch's inputs, for the
    output shapes of a model built without `keras.Input`.
    """
    losses = _sparse_losses(model.loss)
    if not any(loss is not None for loss in jax.tree.leaves(losses, is_leaf=_is_slot)):
        return None
    classes, names = _output_classes(model, x), getattr(model, "output_names", None)

    def check(y, where):
        if y is None:
            return
        for name, labels, count, ignore in _pairs(losses, y, classes, names):
            _check_ids(np.asarray(labels), count, ignore, f"{where}{name}")

    return check


def check_data(model, *data):
    """Check the class-id labels of each `(batches, what)` (`pipeline` Batches) before any step.

    Array labels are checked now, all of them; a dataset's as each batch
    arrives. Each `Batches` is checked once, whatever calls this again.

    Raises:
        ValueError: a label that is not a class id of a sparse categorical loss.
    """
    data = [(batches, what) for batches, what in data
            if batches is not None and not batches.labels_checked]
    if data:
        check = label_check(model, data[0][0].peek()[0])
        for batches, what in data:
            batches.check_labels(check, what)


# The loss functions Keras exports; each `keras.losses.Loss` class wraps one.
_KERAS_LOSS_FUNCTIONS = frozenset(
    value for name, value in vars(keras.losses).items()
    if callable(value) and not isinstance(value, type) and name not in (
        "get", "serialize", "deserialize"))


def keras_loss_function(loss):
    """The `keras.losses` function that `loss` names, is or wraps, or None.

    `loss`: a name (`"mse"`), a `keras.losses.Loss` object or a function.
    None for a loss of the user's own (or one Keras does not export), by
    identity with what `keras.losses` exports, not by where it is defined.
    """
    if isinstance(loss, str):
        try:
            loss = keras.losses.get(loss)
        except ValueError:
            return None
    function = _compat.loss_function(loss)
    return function if function in _KERAS_LOSS_FUNCTIONS else None


def _is_slot(value):
    return value is None or isinstance(value, tuple)


def _sparse_losses(loss):
    """`loss` with each entry replaced by `(ignore_class,)` if sparse categorical, else None."""
    if isinstance(loss, dict):
        return {key: _sparse_losses(value) for key, value in loss.items()}
    if isinstance(loss, (list, tuple)):
        return [_sparse_losses(value) for value in loss]
    if keras_loss_function(loss) is not keras.losses.sparse_categorical_crossentropy:
        return None
    loss = keras.losses.get(loss) if isinstance(loss, str) else loss
    config = loss.get_config() if hasattr(loss, "get_config") else {}
    return (config.get("ignore_class"),)


def _output_classes(model, x):
    """The class count (last dimension) of each output, flattened in Keras's order."""
    outputs = getattr(model, "outputs", None)
    if not outputs:
        outputs = _compat.compute_output_spec(
            model, jax.tree.map(lambda a: keras.KerasTensor(np.shape(a), str(a.dtype)), x),
            training=False)
    return [spec.shape[-1] for spec in jax.tree.leaves(outputs)]


def _pairs(losses, y, classes, names):
    """Yield `(name, labels, classes, ignore_class)` for each output with a sparse loss.

    Labels pair with outputs by position (an array, a list) or by output
    name (a dict); a pairing this check cannot be sure of is skipped, and
    left to Keras.
    """
    if isinstance(y, dict):
        if not names or not set(y) <= set(names):
            return
        keyed = [(key, y[key], names.index(key)) for key in y]
    else:
        keyed = [(index, label, index) for index, label in enumerate(jax.tree.leaves(y))]
    if len(classes) != len(names or classes) or any(i >= len(classes) for *_, i in keyed):
        return
    if isinstance(losses, list):
        # A nested structure of losses (a tuple of an output's loss and a
        # dict of others) pairs with the flat outputs once flattened alike.
        losses = jax.tree.leaves(losses, is_leaf=_is_slot)
        if len(losses) != len(classes):
            return
    for key, label, index in keyed:
        entry = losses
        if isinstance(losses, dict):
            entry = losses.get(names[index] if names else key)
        elif isinstance(losses, list):
            entry = losses[index]
        if entry is not None:
            name = f" (output {names[index] if names else index})" if len(classes) > 1 else ""
            yield name, label, classes[index], entry[0]


def _check_ids(y, classes, ignore_class, where):
    """Raise a `ValueError` if `y` holds anything but class ids in `[0, classes)`."""
    if not is_real(y.dtype) or classes is None:
        return
    bad = (y < 0) | (y >= classes)
    if jnp.issubdtype(y.dtype, jnp.floating):  # bfloat16 too, whose numpy kind is 'V'
        with np.errstate(invalid="ignore"):
            bad |= ~np.isfinite(y) | (y != np.floor(y))
    if ignore_class is not None:
        bad &= y != ignore_class
    if not bad.any():
        return
    position = tuple(int(i) for i in np.argwhere(bad)[0])
    allowed = "" if ignore_class is None else f" (or ignore_class={ignore_class})"
    raise ValueError(
        f"A label of {where} is not a class id: y[{', '.join(map(str, position))}] "
        f"= {y[position].item()!r} (row {position[0]}). Sparse categorical "
        f"crossentropy needs integer class ids from 0 to {classes - 1}{allowed}, "
        f"as the model outputs {classes} classes; {int(bad.sum())} of {bad.size} "
        "labels are not. Fix or drop those rows; for one-hot labels use "
        "categorical_crossentropy."
    )
