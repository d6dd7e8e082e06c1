"""What a host batch must be: checks of its arrays, each refusal naming the fix."""

import numbers

import jax
import jax.numpy as jnp
import keras
import numpy as np

from keras_dp._messages import first_few
from keras_dp.sharding import batch_rows

# How to feed text: what the messages refusing strings say.
TEXT_FIX = (
    "Turn the text into token ids in the input pipeline: adapt a "
    "keras.layers.TextVectorization (or StringLookup) on it, then "
    "tf.data.Dataset.from_tensor_slices((x, y)).map(lambda s, y: (vectorize(s), y))"
    ".batch(...), or call the layer on the arrays first.")


def check_frames(x, y, sample_weight):
    """Raise a `ValueError` naming the columns if a pandas `x`, `y` or `sample_weight` is not numeric.

    numpy reads a frame with a text column, or with a nullable (`Int64`)
    column, as an `object` array, which neither keras_dp nor `model.fit`
    trains on; the message names those columns and how to convert them.
    """
    for name, part in (("x", x), ("y", y), ("sample_weight", sample_weight)):
        for leaf in jax.tree.leaves(part):
            if not type(leaf).__module__.startswith("pandas"):
                continue
            dtypes = getattr(leaf, "dtypes", None)
            columns = dtypes.items() if hasattr(dtypes, "items") else [
                (getattr(leaf, "name", None), getattr(leaf, "dtype", None))]
            odd = [(column, dtype) for column, dtype in columns
                   if not (isinstance(dtype, np.dtype) and dtype.kind in "biuf")]
            if not odd or np.asarray(leaf).dtype.kind in "biuf":
                continue
            listed = first_few([f"{column!r} ({dtype})" for column, dtype in odd])
            raise ValueError(
                f"{name} is a pandas {type(leaf).__name__} with columns numpy reads as "
                f"objects, not numbers: {listed}. keras_dp, like model.fit, trains on "
                "numeric arrays: encode text or category columns as numbers "
                "(pd.get_dummies, or .cat.codes), and make nullable columns floats, "
                "filling missing values first: .astype('float32').")


def array_rows(x, y, sample_weight, what="The data"):
    """The number of rows of array data, checking that x, y and sample_weight agree.

    Unlike `batch_rows`, a disagreement names each array by its role and
    its row count (`x['b']` 29, `y` 30), as Keras's "Data cardinality is
    ambiguous" does, and says whose data it is (`what`, a sentence's
    subject such as "The validation data"). Nothing is cut to the shortest.

    Raises:
        ValueError: arrays with different leading sizes.
    """
    counts = [
        (role + jax.tree_util.keystr(path), np.shape(leaf)[0] if np.ndim(leaf) else None)
        for role, part in (("x", x), ("y", y), ("sample_weight", sample_weight))
        for path, leaf in jax.tree_util.tree_leaves_with_path(part)
    ]
    if len({count for _, count in counts}) > 1:
        listed = first_few([f"{name} {count}" for name, count in counts], "arrays ")
        raise ValueError(
            f"{what} has arrays of different lengths, in rows (first dimension): "
            f"{listed}. Each needs one row per sample, and keras_dp, like "
            "model.fit, does not cut them to the shortest: check that x, y and "
            "sample_weight (and each input of a dict or list x) come from the "
            "same samples.")
    return batch_rows((x, y, sample_weight))


def check_not_ragged(x):
    """Raise a `ValueError` with the fix if `x`, a list or tuple beside `y`, is items of several lengths.

    Such a list is read as the model's inputs, which must all have one row
    per sample; a list of samples of different lengths (tokenised text)
    needs padding to one length first.
    """
    if not isinstance(x, (list, tuple)) or len(x) < 2:
        return
    lengths = {_length(item) for item in x}
    if len(lengths) < 2:
        return
    known = sorted(length for length in lengths if length is not None)
    span = f"{known[0]} to {known[-1]}" if known else "none"
    raise ValueError(
        f"x is a Python {type(x).__name__} of {len(x)} items of different lengths ({span}"
        f"{', and scalars' if None in lengths else ''}). Beside y, a list is "
        "read as the model's inputs, which all need one row per sample. If "
        "the items are samples (sequences of different lengths), pad them to "
        "one length first: keras.utils.pad_sequences(x) gives one array of "
        "shape (samples, longest)."
    )


def check_not_scalars(x, y, sample_weight):
    """Raise a `ValueError` with the fix if `x`, `y` or `sample_weight` is a number, or a list of numbers.

    Beside `y`, a list is read as one array per model input (or output), as
    in Keras, so a list of numbers would be that many one-value arrays; it
    is meant as one value per sample, an array. So is a list of lists of
    numbers (a table's rows), which was read as that many inputs of no rows.
    """
    for name, part in (("x", x), ("y", y), ("sample_weight", sample_weight)):
        if isinstance(part, (list, tuple)) and part and all(
                isinstance(item, (str, bytes)) for item in part):
            raise ValueError(
                f"{name} is a Python {type(part).__name__} of {len(part)} strings; keras_dp "
                f"compiles its steps with JAX, which has no strings. {TEXT_FIX}")
        if isinstance(part, (list, tuple)) and part and all(
                not isinstance(item, (list, tuple, dict)) and np.ndim(item) == 0
                for item in part):  # np.ndim of a tuple of unlike arrays raises
            raise ValueError(
                f"{name} is a Python {type(part).__name__} of {len(part)} numbers. A list is "
                "read as one array per model input or output, as in Keras; for one "
                f"value per sample, pass an array: np.asarray({name})."
            )
        if isinstance(part, (list, tuple)) and part and all(
                _numbers(item) for item in part):  # rows of a table, as nested lists
            raise ValueError(
                f"{name} is a Python {type(part).__name__} of {len(part)} "
                f"{type(part[0]).__name__}s of numbers. A list is read as one array per "
                "model input or output, as in Keras (whose fit refuses lists of numbers); "
                f"for one row per sample, pass an array: np.asarray({name})."
            )
        if part is not None and not isinstance(part, (dict, list, tuple)) and np.ndim(part) == 0:
            raise ValueError(
                f"{name} is a single value ({part!r}), not an array with one row per "
                f"sample. Pass an array of one row per sample for {name}."
            )


def _numbers(item):
    """Whether `item` is a non-empty Python list or tuple of numbers."""
    return isinstance(item, (list, tuple)) and bool(item) and all(
        not isinstance(value, (list, tuple, dict, str, bytes)) and np.ndim(value) == 0
        for value in item)


def _length(item):
    """Rows of one item of a list `x`: a sample's length, or a group of inputs' rows.

    An item that is a list, tuple or dict of arrays is a group of the
    model's inputs (`keras.Model([[a, b], c], ...)`), whose rows are its
    first array's; any other list is one sample (token ids), its length.
    """
    group = list(item.values()) if isinstance(item, dict) else item
    if isinstance(group, (list, tuple)) and group and all(
            isinstance(part, (list, tuple, dict)) or len(getattr(part, "shape", ())) > 0
            for part in group) and not all(isinstance(part, list) for part in group):
        return _length(group[0])
    if isinstance(item, (list, tuple)):
        return len(item)
    shape = getattr(item, "shape", None)
    return shape[0] if shape else None


def check_class_ids(class_weight):
    """Raise a `ValueError` naming a key of `class_weight` that is not an integer class id.

    Labels are class ids by the time they reach a step; a key such as
    `"cat"` matches none (`int("cat")` failed with "invalid literal for
    int()"), and a key such as 1.5 was cut to 1; 1.0 and True are class 1.
    """
    for key in class_weight:
        # Integral floats and bools pass, as in Keras's lookup: np.unique of
        # float or bool labels gives such keys (1.0 and True are class 1).
        integral = isinstance(key, (numbers.Real, np.bool_)) and float(key).is_integer()
        if not integral:
            raise ValueError(
                "`class_weight` maps integer class ids to weights, as in model.fit: "
                f"{{0: 1.0, 1: 5.0}}. Received the key {key!r} (of type "
                f"{type(key).__name__}). Labels that are names are turned into ids "
                "before training (keras.layers.StringLookup, or a dict of your own); "
                "key class_weight by those ids.")


def is_real(dtype):
    """Whether `dtype` is a bool, integer or real float dtype, ml_dtypes' included.

    numpy gives `bfloat16` and the `float8` types (from ml_dtypes, as JAX
    makes them) the kind `'V'`, as it does structured arrays; JAX's
    `issubdtype` knows them as floats (and `int4` as an integer).
    """
    return dtype.kind in "biuf" or (dtype.kind == "V" and dtype.names is None and (
        jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)))


def check_dtypes(batch, where="The data"):
    """Raise a `ValueError` naming `where` and the array if one of `batch`'s is of a dtype Keras does not train on.

    `batch` is `(x, y, sample_weight)`, as `unpack` gives it.

    Numbers pass where Keras's `model.fit` takes them: bool, integers,
    floats (`bfloat16` and `float8` too), and complex numbers, which a layer
    casts to its own dtype as under Keras. Text, objects, structured
    arrays, and numbers of a dtype Keras does not take (`np.longdouble`,
    `int4`) are refused with the fix.
    """
    for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
        if (is_real(leaf.dtype) or leaf.dtype.kind == "c") and _keras_dtype(leaf.dtype):
            continue
        name = ("x", "y", "sample_weight")[path[0].idx] + jax.tree_util.keystr(path[1:])
        raise ValueError(f"{where} has an array of dtype {leaf.dtype} ({name}, shape "
                         f"{leaf.shape})" + _dtype_fix(leaf, name))


def _keras_dtype(dtype):
    """Whether Keras names `dtype` (`keras.backend.standardize_dtype`), as its fit needs."""
    try:
        keras.backend.standardize_dtype(dtype)
    except ValueError:
        return False
    return True


def _dtype_fix(array, name):
    """The rest of the message refusing `array`'s dtype: why, and the fix."""
    dtype = array.dtype
    if _holds_text(array):
        return (" holding text; keras_dp compiles its steps with JAX, which has no "
                f"strings. {TEXT_FIX}")
    if dtype.names:
        return (f", a structured array of fields {', '.join(dtype.names)}; Keras trains on "
                "plain arrays. Stack the fields into one: "
                f"numpy.lib.recfunctions.structured_to_unstructured({name}), or pass a dict "
                f"{{field: {name}[field]}} for a model with an input per field.")
    if is_real(dtype) or dtype.kind == "c":
        return (f", a dtype Keras does not take (model.fit fails with \"Invalid dtype: "
                f"{dtype}\"). Cast it to one it does: {name}.astype('float32'), or "
                "'int32' for ids.")
    if dtype.kind == "O" and array.size and np.ndim(array.flat[0]) == 0 and isinstance(
            array.flat[0], (numbers.Number, np.generic)):
        return (" holding Python numbers; keras_dp, like model.fit, trains on arrays "
                f"of a numeric dtype. Convert it: np.asarray({name}, dtype='float32').")
    return ("; keras_dp trains on numeric arrays only. Convert it to numbers first; "
            "ragged sequences become `object` arrays: pad them to one length "
            "(keras.utils.pad_sequences).")


def _holds_text(array):
    """Whether `array` holds strings: numpy's `str_`/`bytes_`, or objects that are (tf.data's)."""
    if array.dtype.kind in "SU":
        return True
    return array.dtype.kind == "O" and array.size > 0 and isinstance(
        array.flat[0], (str, bytes))
