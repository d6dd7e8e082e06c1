"""Sources: what the user passes to `fit`, as host batches epoch after epoch.

keras_dp accepts what `model.fit` accepts most often: numpy arrays (`x`, `y`,
`sample_weight`; `x` may be a dict or list of arrays; pandas objects and
sparse matrices, densified, count as arrays), a `(x, y)` or
`(x, y, sample_weight)` tuple of arrays, a `tf.data.Dataset` of batches, a
`keras.utils.PyDataset`, a Grain dataset or loader, or any re-iterable of
such batches. `make_batches` turns each into a `Source`
(`keras_dp.sources.source`): `ArrayBatches` or `IterableBatches`, whose
`epoch(e)` yields host batches `(x, y, sample_weight)` of numpy arrays;
`StepsPerEpoch` and `FirstSteps` (`keras_dp.sources.stream`) read a source
for a count of steps per epoch (as `model.fit` does, from one iterator that
goes on across epochs) or per evaluation. How `x` and `y` are read (which
list is the model's inputs, the validation split) is
`keras_dp.sources.inputs`'s; the feeds (`keras_dp.core.feed`) put the
batches on the devices.
"""

from keras_dp.checks import data as data_checks
from keras_dp.sources import inputs
from keras_dp.sources.arrays import ArrayBatches
from keras_dp.sources.batch import TRAINING
from keras_dp.sources.batch import VALIDATION
from keras_dp.sources.batch import unpack
from keras_dp.sources.inputs import checked_arrays
from keras_dp.sources.inputs import model_inputs
from keras_dp.sources.inputs import naming_list_reading
from keras_dp.sources.inputs import predict_inputs
from keras_dp.sources.inputs import split_validation
from keras_dp.sources.inputs import validation_source
from keras_dp.sources.iterables import IterableBatches
from keras_dp.sources.source import Source
from keras_dp.sources.stream import FirstSteps
from keras_dp.sources.stream import StepsPerEpoch

__all__ = [
    "ArrayBatches",
    "FirstSteps",
    "IterableBatches",
    "Source",
    "StepsPerEpoch",
    "TRAINING",
    "VALIDATION",
    "check_ends",
    "check_one_pass",
    "checked_arrays",
    "make_batches",
    "model_inputs",
    "naming_list_reading",
    "predict_inputs",
    "split_validation",
    "unpack",
    "validation_source",
]


def make_batches(x, y=None, sample_weight=None, *, batch_size=None, shuffle=False,
                 seed=0, class_weight=None, what="The data", keras_peeks=True,
                 keras_resets=True, steps=None):
    """Wrap user data as `Source`, validating what can be checked up front.

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
        steps: read only the first `steps` batches of each pass
            (`FirstSteps`: `evaluate(steps=...)`, `validation_steps`).

    Raises:
        ValueError: arrays of different lengths or of a non-numeric dtype,
            no rows, a `batch_size` below 1 or given with a dataset, or
            `class_weight` with a key that is not a class id, with
            `sample_weight` or with several outputs.
    """
    if x is None:
        raise ValueError(f"{what} is None: pass x (and y), or a dataset.")
    if class_weight is not None:  # once here, not at every dataset batch
        data_checks.check_class_ids(class_weight)
    if inputs.is_array_data(x, y):
        x, y, sample_weight = inputs.checked_arrays(x, y, sample_weight)
        batches = ArrayBatches(x, y, sample_weight, batch_size=batch_size, shuffle=shuffle,
                               seed=seed, class_weight=class_weight, what=what)
        return batches if steps is None else FirstSteps(batches, steps)
    if y is not None or sample_weight is not None:
        given = " and ".join(name for name, value in (("y", y), ("sample_weight", sample_weight))
                             if value is not None)
        raise ValueError(
            "`y` and `sample_weight` go with array inputs only; a dataset "
            f"carries its own. Received x of type {type(x).__name__} and {given}: "
            "put them in its batches, (x, y) or (x, y, sample_weight)."
        )
    if batch_size is not None and inputs.may_be_inputs(x):
        raise ValueError(
            f"x is a Python list of {len(x)} items, which keras_dp reads as a list of "
            "batches: its items are not arrays of one row count, nor the nesting of a "
            "Functional model's inputs. A list of batches is batched already, so drop "
            f"`batch_size` (received batch_size={batch_size}). {inputs.LIST_AS_INPUTS}"
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
    return batches if steps is None else FirstSteps(batches, steps)


def check_ends(batches, what, steps):
    """Raise a `ValueError` at once if a pass over `batches` would never end.

    A source known to be endless (`IterableBatches.endless`: a tf.data
    `repeat()`, a PyDataset without a length, an endless Grain pipeline)
    needs a count of steps, which `StepsPerEpoch` or `FirstSteps` apply;
    without one, `model.fit` trains (or validates) forever.

    Args:
        batches: the `Source` to read.
        what: the argument they came from (`"x"`, `"validation_data"`).
        steps: the argument that bounds a pass (`"steps_per_epoch"`).
    """
    if batches.endless is None:
        return
    raise ValueError(
        f"`{what}` is {batches.endless}, and no `{steps}` says where a pass ends: it would "
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
        batches: the `Source` to read.
        passes: how many times they would be read whole.
        what: the argument they came from (`"x"`, `"validation_data"`).
        epochs: what decides `passes`, as text for the message.
    """
    if passes <= 1 or batches.reiterable:
        return
    steps = "steps_per_epoch" if what == "x" else "validation_steps"
    raise ValueError(
        f"`{what}` is a one-shot iterator (a generator), used up by one pass, and "
        f"this fit would read it {passes} times ({epochs}): every pass after the "
        f"first would have no data. Pass `{steps}` with a generator that never "
        "ends, or data that can be read again: arrays, a list of batches, a "
        "tf.data.Dataset or a keras.utils.PyDataset.")


