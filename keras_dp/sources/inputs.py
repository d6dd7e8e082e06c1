"""How `fit` reads `x` and `y`: which list or tuple is the inputs, validation data and its split."""

import contextlib

import jax
import keras
import numpy as np

from keras_dp import _compat
from keras_dp import options
from keras_dp.checks import data as data_checks
from keras_dp.sources.batch import densify
from keras_dp.sources.batch import is_sparse
from keras_dp.sources.batch import unpack


def checked_arrays(x, y, sample_weight):
    """`(x, y, sample_weight)` of array data, dense and checked.

    A tuple `x` without `y` is unpacked as `(x, y, sample_weight)`, as
    `model.fit` reads it; sparse matrices become dense; data frames with
    columns that are not numbers, ragged arrays and scalars are refused with
    the fix (a `ValueError`).
    """
    if isinstance(x, tuple) and y is None:
        x, y, sample_weight = unpack(x)
    x, y, sample_weight = densify((x, y, sample_weight))
    data_checks.check_frames(x, y, sample_weight)
    data_checks.check_not_ragged(x)
    data_checks.check_not_scalars(x, y, sample_weight)
    return x, y, sample_weight


# Said where a list, read as batches, may have been meant as the model's inputs.
LIST_AS_INPUTS = ("If the list is the model's inputs, as model.fit reads it, pass it with "
                  "y, or alone as a tuple `(x,)`.")


def may_be_inputs(x):
    """Whether `x` is a list that keras_dp reads as batches but `model.fit` as the inputs.

    A list whose items are all tuples is plainly `(x, y)` batches.
    """
    return isinstance(x, list) and not all(isinstance(item, tuple) for item in x)


def model_inputs(x, y, model):
    """Read a list or tuple `x` without `y` as Keras does where the model's inputs settle it.

    keras_dp also takes a list of batches, where `model.fit` reads any list
    `x` as the model's inputs. A Functional model's input structure decides:
    an `x` of that structure (nested lists and tuples alike, dicts by key)
    whose arrays share one row count is the inputs, as under `model.fit`:
    `[[a, b], c]` for `keras.Model([[a, b], c], ...)`, or `(a, b)` for a
    two-input model trained by `add_loss` alone. Anything else keeps
    keras_dp's reading: a list is batches (or one array per input, if its
    items are arrays of one row count), a tuple is `(x, y[, sample_weight])`.

    Args:
        x, y: the data as given.
        model: the model that will read it.

    Returns:
        `x`, or `(x,)` for the model's inputs: `make_batches` reads that as x alone.
    """
    if y is None and isinstance(x, (list, tuple)):
        structure = _compat.input_structure(model)
        if structure is not None and _rows_of(x, structure) is not None:
            return (x,)
    return x


@contextlib.contextmanager
def naming_list_reading(x, y=None):
    """Add to a `ValueError` raised inside how a list `x` without `y` was read, where Keras reads it otherwise.

    A nested list of arrays of one row count that no Functional model's
    input structure claimed (`model_inputs`: a subclassed model, say) is
    read as a list of batches; `model.fit` would take it as the inputs. An
    error building on its first "batch" then says both readings and fixes.
    """
    try:
        yield
    except ValueError as error:
        if y is not None or not may_be_inputs(x) or _inputs_alone(x) or _rows(x) is None:
            raise
        raise ValueError(
            f"{error}\nx is a Python list of {len(x)} items without y, which keras_dp "
            "reads as a list of batches (its items are not all arrays, nor in the "
            "nesting of a Functional model's inputs); model.fit would read it as the model's "
            "inputs. If it is the inputs, pass it with y, or alone as a tuple `(x,)`; "
            "if it is batches, make each one a tuple `(x, y)` or `(x,)`.") from error


def predict_inputs(x, model):
    """Read `predict`'s `x` as `model.predict` does: a tuple of one array per model input is the inputs.

    Beyond `model_inputs`: elsewhere a tuple without `y` is a packed
    `(x, y[, sample_weight])`. A model with as many inputs as the tuple has
    arrays (a Siamese network's `(left, right)`) takes them as its inputs,
    as `model.predict((a, b))` does; so does a subclassed model, whose
    inputs Keras cannot count (`model.predict` hands it the whole tuple); a
    one-input Functional or Sequential model still reads `(x, y)` as x and
    labels.

    Args:
        x: `predict`'s data.
        model: the model that will predict.

    Returns:
        `x`, or `(x,)` for the model's inputs: `make_batches` unpacks it to x.
    """
    read = model_inputs(x, None, model)
    if read is not x:
        return read
    if isinstance(x, tuple) and len(x) > 1 and _inputs_alone(x):
        inputs = functional_inputs(model)
        subclassed = not inputs and not isinstance(model, keras.Sequential)
        if subclassed or len(inputs) == len(x):
            return (x,)
    return x


def functional_inputs(model):
    """`model.inputs` (its `keras.Input` tensors, flat), or `()` for a model without them."""
    try:  # a subclassed model has no inputs of its own (Keras raises)
        return model.inputs or ()
    except (AttributeError, ValueError):
        return ()


def _rows_of(x, structure):
    """The one row count of `x`'s arrays if `x` has `structure`'s nesting, else None."""
    rows = set()

    def matches(part, spec):
        if isinstance(spec, dict):
            return isinstance(part, dict) and set(part) == set(spec) and all(
                matches(part[key], spec[key]) for key in spec)
        if isinstance(spec, (list, tuple)):
            return isinstance(part, (list, tuple)) and len(part) == len(spec) and all(
                map(matches, part, spec))
        if not _is_array(part):
            return False
        rows.add(np.shape(part)[:1])
        return True

    if not matches(x, structure) or len(rows) != 1:
        return None
    return rows.pop()


def validation_tuple(validation_data, model):
    """`validation_data` as `model.fit` reads it: a list `[x, y[, sample_weight]]` is the tuple.

    Beside an array, a tuple is several inputs (`[(left, right), y]`), as in
    `model.fit`. A list of tuples only is `[x, y[, sample_weight]]` too
    where `model`'s input structure settles it (`model_inputs`): its first
    item has the nesting of a Functional model's inputs and all its arrays
    share one row count (`[(a, b), (y1, y2)]` for a two-input, two-output
    model). Any other list of tuples is a list of whole `(x, y)` batches,
    returned as it is.
    """
    if not isinstance(validation_data, list) or not 1 <= len(validation_data) <= 3:
        return validation_data
    if all(isinstance(item, tuple) for item in validation_data):
        read = _has_input_structure(validation_data, model)
    else:
        read = len(validation_data) >= 2
    return tuple(validation_data) if read else validation_data


def _has_input_structure(data, model):
    """Whether `data[0]` has `model`'s input structure, and all of `data`'s arrays one row count."""
    structure = _compat.input_structure(model)
    if structure is None:
        return False
    rows = _rows_of(data[0], structure)
    return rows is not None and _rows(data) == rows


def validation_source(validation_data, batch_size, validation_batch_size, model):
    """`(data, batch_size)` for `fit`'s validation, as `model.fit` reads them.

    The data as `validation_tuple` reads it for `model`; for arrays, the
    batch size is `validation_batch_size`, else `batch_size`; a dataset is
    batched already, so it gets None.

    Raises:
        ValueError: `validation_batch_size` with validation data that is a
            dataset.
    """
    validation_data = validation_tuple(validation_data, model)
    if validation_batch_size is not None:
        validation_batch_size = options.check_count("validation_batch_size", validation_batch_size, 1)
    if is_array_data(validation_data):
        return validation_data, validation_batch_size or batch_size
    if validation_batch_size is not None:
        raise ValueError(
            "`validation_batch_size` slices validation arrays; this validation "
            "data is a dataset, batched already. Received: "
            f"validation_batch_size={validation_batch_size}."
        )
    return validation_data, None


def split_validation(x, y, sample_weight, validation_split, validation_data=None):
    """Split off the last `validation_split` of array data, as `model.fit` does.

    The split is taken before any shuffling, so the validation rows are the
    same every epoch and in every run.

    Returns:
        `((x, y, sample_weight), (x_val, y_val, sample_weight_val))`; with
        x alone, `(((x,), None, None), (x_val,))`, which `make_batches`
        reads as x alone.

    Raises:
        ValueError: `validation_data` given too, a fraction outside (0, 1),
            data that is not arrays, or a split that leaves either part
            without rows.
    """
    if validation_data is not None:
        raise ValueError(
            "Pass either `validation_data` or `validation_split`, not "
            "both: keras_dp would not know which to score."
        )
    if not 0 < validation_split < 1:
        raise ValueError(
            "`validation_split` is the fraction of rows held out, between 0 "
            f"and 1. Received: validation_split={validation_split}."
        )
    if not is_array_data(x, y):
        raise ValueError(
            "`validation_split` works on arrays only; a dataset cannot be "
            "split without reading it. Pass `validation_data=` instead. "
            f"Received x of type {type(x).__name__}."
        )
    arrays = jax.tree.map(np.asarray, checked_arrays(x, y, sample_weight))
    total = data_checks.array_rows(*arrays)
    split = int(np.floor(total * (1 - validation_split)))
    if split == 0 or split == total:
        raise ValueError(
            f"`validation_split={validation_split}` of {total} rows leaves "
            f"{split} rows for training and {total - split} for validation; "
            "both need at least one. Use a fraction that splits the data."
        )
    train, held_out = (jax.tree.map(lambda array: array[rows], arrays)
                       for rows in (slice(None, split), slice(split, None)))
    if train[1] is None and train[2] is None:  # x alone stays x alone, not batches
        return ((train[0],), None, None), (held_out[0],)
    return train, held_out


def is_array_data(x, y=None):
    """Whether `x` (beside `y`) is in-memory arrays, which `batch_size` slices.

    A dataset, generator or other iterable is batched already.
    """
    if isinstance(x, tuple) and y is None:  # a packed (x,), (x, y[, sample_weight])
        if len(x) == 1 and isinstance(x[0], (list, tuple)):
            # x alone (`model_inputs`): inputs nested as deep as the model's.
            return _rows(x[0]) is not None
        x, y = (x + (None, None))[:2]
    # A list or tuple beside `y` is several model inputs, as in `model.fit`.
    # Alone, a list of arrays of one row count is too (`model.predict([a, b])`);
    # any other list is a list of batches.
    return isinstance(x, dict) or _is_array(x) or (
        isinstance(x, (list, tuple)) and (y is not None or _inputs_alone(x))
    )


def _rows(x):
    """The one row count of all of `x`'s arrays, however nested, else None."""
    return _rows_of(x, _nesting(x))


def _nesting(x):
    """`x`'s lists, tuples and dicts, with None for each other leaf."""
    if isinstance(x, dict):
        return {key: _nesting(value) for key, value in x.items()}
    if isinstance(x, (list, tuple)):
        return [_nesting(item) for item in x]
    return None


def _is_array(x):
    return hasattr(x, "__array__") or is_sparse(x)


def _inputs_alone(x):
    return bool(x) and all(_is_array(item) for item in x) and len(
        {np.shape(item)[:1] for item in x}) == 1
