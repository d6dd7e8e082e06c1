"""What a host batch is: `(x, y, sample_weight)` of numpy arrays, dense, class weights applied."""

import jax
import keras
import numpy as np


def unpack(batch):
    """Split a batch into `(x, y, sample_weight)`, `None` where absent.

    As in Keras, a list is read like a tuple: `[x, y]` is x and y.
    """
    if isinstance(batch, list):
        batch = tuple(batch)
    if isinstance(batch, tuple):
        if not 1 <= len(batch) <= 3:
            raise ValueError(
                "A batch must be x, (x,), (x, y) or (x, y, sample_weight). "
                f"Received a tuple of {len(batch)} elements."
            )
        return tuple(batch) + (None,) * (3 - len(batch))
    return batch, None, None


def densify(tree):
    """`tree` with each sparse array made a dense numpy array.

    Sparse arrays: `scipy.sparse` matrices and arrays, `tf.SparseTensor`,
    and JAX's `jax.experimental.sparse` arrays (`BCOO`, ...), from arrays or
    from any dataset's batches. Keras's `model.fit` on JAX hands a batch's
    sparse arrays to the model as JAX sparse arrays, which compute what
    their dense matrices do; keras_dp splits the rows of each batch over
    the devices, which it does for dense arrays, so it densifies them on the
    host as they come (the memory of the dense batch).
    """
    return jax.tree.map(_dense, tree, is_leaf=is_sparse)


def is_sparse(leaf):
    """Whether `leaf` is a `scipy.sparse` matrix or array, a `tf.SparseTensor` or a JAX sparse array."""
    module = type(leaf).__module__
    return (module.startswith("scipy.sparse") and hasattr(leaf, "toarray")) or (
        module.startswith("tensorflow") and type(leaf).__name__ == "SparseTensor") or (
        module.startswith("jax.experimental.sparse") and hasattr(leaf, "todense"))


def _dense(leaf):
    if not is_sparse(leaf):
        return leaf
    if hasattr(leaf, "toarray"):
        return leaf.toarray()
    if hasattr(leaf, "todense"):  # JAX's
        return np.asarray(leaf.todense())
    import tensorflow as tf

    return tf.sparse.to_dense(leaf).numpy()


# Whose data a message names (`make_batches`'s `what`).
TRAINING = "The training data"
VALIDATION = "The validation data"


def class_weight_to_sample_weight(y, class_weight):
    """Per-sample weights `class_weight[class of row]`, 1 for unlisted classes.

    The class of a row is its label when `y` holds class ids (shape `(n,)`
    or `(n, 1)`), and the argmax when `y` holds one-hot rows.
    """
    y = np.asarray(y)
    if y.ndim > 1:
        y = np.argmax(y, axis=-1) if y.shape[-1] != 1 else np.squeeze(y, axis=-1)
    ids = np.round(y).astype(np.int64)
    weights = np.ones(ids.shape[0], dtype=keras.config.floatx())
    for class_id, weight in class_weight.items():
        weights[ids == int(class_id)] = weight
    return weights


def apply_class_weight(batch, class_weight):
    """`batch` with `class_weight` turned into its sample weights (see above)."""
    x, y, sample_weight = batch
    if sample_weight is not None:
        raise ValueError(
            "Pass either `class_weight` or `sample_weight`, not both: "
            "class_weight is turned into sample weights. To combine them, "
            "multiply the class weights into your sample_weight yourself."
        )
    if y is None or len(jax.tree.leaves(y)) != 1 or not hasattr(y, "shape"):
        raise ValueError(
            "`class_weight` needs one array of labels `y` (a model with a "
            "single output), as in model.fit. For several outputs, pass "
            "per-output `sample_weight` instead."
        )
    return x, y, class_weight_to_sample_weight(y, class_weight)


