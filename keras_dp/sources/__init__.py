"""The host input pipeline: user data to host batches, epoch after epoch.

keras_dp accepts what `model.fit` accepts most often: numpy arrays (`x`, `y`,
`sample_weight`; `x` may be a dict or list of arrays; pandas objects and
sparse matrices, densified, count as arrays), a `(x, y)` or
`(x, y, sample_weight)` tuple of arrays, a `tf.data.Dataset` of batches, a
`keras.utils.PyDataset`, or any re-iterable of such batches. `make_batches`
turns each into a `Batches` object (`ArrayBatches` or `IterableBatches`)
whose `epoch(e)` yields host batches `(x, y, sample_weight)` of numpy arrays.
`stream` then shapes them in time (`StepsPerEpoch`, K-step groups, the
look-ahead thread); `keras_dp.core.placement` puts them on the devices.
"""

import contextlib

import jax
import keras
import numpy as np

from keras_dp import _compat
from keras_dp.sources.arrays import ArrayBatches
from keras_dp.sources.batch import TRAINING
from keras_dp.sources.batch import VALIDATION
from keras_dp.sources.batch import array_rows
from keras_dp.sources.batch import batch_rows
from keras_dp.sources.batch import check_class_ids
from keras_dp.sources.batch import check_auto
from keras_dp.sources.batch import check_count
from keras_dp.sources.batch import check_frames
from keras_dp.sources.batch import check_not_scalars
from keras_dp.sources.batch import check_not_ragged
from keras_dp.sources.batch import class_weight_to_sample_weight
from keras_dp.sources.batch import densify
from keras_dp.sources.batch import is_sparse
from keras_dp.sources.batch import unpack
from keras_dp.sources.iterables import IterableBatches
from keras_dp.sources.iterables import hide_gpus_from_tensorflow
from keras_dp.sources.stream import FirstSteps
from keras_dp.sources.stream import StepsPerEpoch
from keras_dp.sources.stream import group_steps
from keras_dp.sources.stream import prefetch
from keras_dp.sources.stream import steps_per_execution

__all__ = [
    "ArrayBatches",
    "FirstSteps",
    "IterableBatches",
    "LIST_AS_INPUTS",
    "StepsPerEpoch",
    "TRAINING",
    "VALIDATION",
    "batch_rows",
    "check_auto",
    "check_count",
    "check_ends",
    "check_one_pass",
    "class_weight_to_sample_weight",
    "functional_inputs",
    "group_steps",
    "hide_gpus_from_tensorflow",
    "is_array_data",
    "make_batches",
    "may_be_inputs",
    "model_inputs",
    "naming_list_reading",
    "predict_inputs",
    "prefetch",
    "split_validation",
    "steps_per_execution",
    "unpack",
    "validation_source",
    "validation_tuple",
]


def make_batches(x, y=None, sample_weight=None, *, batch_size=None, shuffle=False,
                 seed=0, class_weight=None, what="The data", keras_peeks=True,
                 keras_resets=True):
    """Wrap user data as `Batches`, validating what can be checked up front.

    Args:
        x: arrays (with `y`), a `(x, y[, sample_weight])` tuple, a
            `tf.data.Dataset` of batches, or a re-iterable of batches.
        y, sample_weight: arrays, only with array `x`.
        batch_size: global rows per step for arrays (default 32, as in
            Keras), any positive number whatever the device count; must be
            `None` for datasets, which are batched already.
        shuffle: reshuffle array rows every epoch (seeded by `seed`), or
            a `keras.utils.PyDataset`'s batches (by index, as `model.fit`
            does); other datasets are read as they come.
        seed: seed of the shuffle order; the same seed gives the same order.
        class_weight: `{class_id: weight}`, turned into per-sample weights
            from the labels as `model.fit` does (integer ids, or the argmax
            of one-hot rows); classes not listed weigh 1.
        what: whose data it is, as its messages name it ("The validation
            data"; `TRAINING`, `VALIDATION`).
        keras_peeks, keras_resets: how the Keras call that the data is read
            for reads its first batch, so that a dataset is read as it
            (`IterableBatches.read_first_as_keras`): whether Keras reads a
            batch to build from from a pass of its own
            (`build.keras_reads_a_batch_to_build`), and whether it ends a
            pass before the first epoch without that read (`fit` and
            `evaluate` do, `predict` does not; `"each pass"`: before each,
            as `fit`'s validation). Arrays read the same either way.

    Raises:
        ValueError: arrays of different lengths or of a non-numeric dtype,
            no rows, a `batch_size` below 1 or given with a dataset, or
            `class_weight` with a key that is not a class id, with
            `sample_weight` or with several outputs.
    """
    if x is None:
        raise ValueError(f"{what} is None: pass x (and y), or a dataset.")
    if class_weight is not None:  # once here, not at every dataset batch
        check_class_ids(class_weight)
    if is_array_data(x, y):
        x, y, sample_weight = checked_arrays(x, y, sample_weight)
        return ArrayBatches(x, y, sample_weight, batch_size=batch_size, shuffle=shuffle,
                            seed=seed, class_weight=class_weight, what=what)
    if y is not None or sample_weight is not None:
        given = " and ".join(name for name, value in (("y", y), ("sample_weight", sample_weight))
                             if value is not None)
        raise ValueError(
            "`y` and `sample_weight` go with array inputs only; a dataset "
            f"carries its own. Received x of type {type(x).__name__} and {given}: "
            "put them in its batches, (x, y) or (x, y, sample_weight)."
        )
    if batch_size is not None and may_be_inputs(x):
        raise ValueError(
            f"x is a Python list of {len(x)} items, which keras_dp reads as a list of "
            "batches: its items are not arrays of one row count, nor the nesting of a "
            "Functional model's inputs. A list of batches is batched already, so drop "
            f"`batch_size` (received batch_size={batch_size}). {LIST_AS_INPUTS}"
        )
    if batch_size is not None:
        raise ValueError(
            "Do not pass `batch_size` with a dataset: it is batched already. "
            f"Received: batch_size={batch_size}. Batch the dataset itself "
            "(for tf.data, `dataset.batch(n)`)."
        )
    batches = IterableBatches(x, class_weight=class_weight, shuffle=shuffle, seed=seed,
                              what=what)
    batches.read_first_as_keras(keras_peeks, resets=keras_resets or keras_peeks)
    return batches


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
    check_frames(x, y, sample_weight)
    check_not_ragged(x)
    check_not_scalars(x, y, sample_weight)
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


def check_ends(batches, what, steps):
    """Raise a `ValueError` at once if a pass over `batches` would never end.

    A source known to be endless (`IterableBatches.endless`: a tf.data
    `repeat()`, a PyDataset without a length, an endless Grain pipeline)
    needs a count of steps, which `StepsPerEpoch` or `FirstSteps` apply;
    without one, `model.fit` trains (or validates) forever.

    Args:
        batches: the `Batches` to read.
        what: the argument they came from (`"x"`, `"validation_data"`).
        steps: the argument that bounds a pass (`"steps_per_epoch"`).
    """
    endless = getattr(batches, "endless", None)
    if endless is None:
        return
    raise ValueError(
        f"`{what}` is {endless}, and no `{steps}` says where a pass ends: it would "
        f"run forever (as under model.fit). Pass `{steps}=N`, the batches per pass, "
        "or data that ends.")


def check_one_pass(batches, passes, what, epochs):
    """Raise a `ValueError` at once if a one-shot iterator would be read `passes` times.

    A generator is used up by its first pass, so the passes after it would
    have no data; `model.fit` trains (or validates) them on the
    generator's first 2 batches again, which it kept to look at.
    `StepsPerEpoch` and `FirstSteps` read on from where they stopped, so
    they pass.

    Args:
        batches: the `Batches` to read.
        passes: how many times they would be read whole.
        what: the argument they came from (`"x"`, `"validation_data"`).
        epochs: what decides `passes`, as text for the message.
    """
    if passes <= 1 or getattr(batches, "reiterable", True):
        return
    steps = "steps_per_epoch" if what == "x" else "validation_steps"
    raise ValueError(
        f"`{what}` is a one-shot iterator (a generator), used up by one pass, and "
        f"this fit would read it {passes} times ({epochs}): every pass after the "
        f"first would have no data. Pass `{steps}` with a generator that never "
        "ends, or data that can be read again: arrays, a list of batches, a "
        "tf.data.Dataset or a keras.utils.PyDataset.")


def validation_tuple(validation_data, model=None):
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
    structure = None if model is None else _compat.input_structure(model)
    if structure is None:
        return False
    rows = _rows_of(data[0], structure)
    return rows is not None and _rows(data) == rows


def validation_source(validation_data, batch_size=None, validation_batch_size=None,
                      model=None):
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
        validation_batch_size = check_count("validation_batch_size", validation_batch_size, 1)
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
    total = array_rows(*arrays)
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

