"""The input pipeline: user data to host batches to sharded device batches.

keras_dp accepts what `model.fit` accepts most often: numpy arrays (`x`, `y`,
`sample_weight`; `x` may be a dict or list of arrays), a `(x, y)` or
`(x, y, sample_weight)` tuple of arrays, a `tf.data.Dataset` of batches, or
any re-iterable of such batches. Each becomes a `Batches` object that yields
host batches `(x, y, sample_weight)` of numpy arrays, epoch after epoch.

On the devices, a batch whose rows divide evenly by the device count is
sharded along `"batch"`; a final partial batch that does not divide is
replicated instead, so every device computes it whole and the result is
exactly that of one device. No row is ever dropped or invented.
"""

import itertools

import jax
import numpy as np

from keras_dp import mesh as mesh_lib


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


def batch_rows(batch):
    """The number of rows of a batch, checking that every array agrees.

    Raises:
        ValueError: arrays with different leading sizes, or no arrays.
    """
    leaves = jax.tree.leaves(batch)
    if not leaves:
        raise ValueError("A batch holds no arrays. Each batch needs at least x.")
    sizes = {np.shape(leaf)[0] if np.ndim(leaf) else None for leaf in leaves}
    if len(sizes) != 1 or None in sizes:
        shapes = [np.shape(leaf) for leaf in leaves]
        raise ValueError(
            "Every array of a batch must have the same number of rows (its "
            f"first dimension). Received arrays of shapes {shapes}. Check "
            "that x, y and sample_weight have one entry per sample."
        )
    return sizes.pop()


def to_device(batch, mesh):
    """Place a host batch on `mesh`: sharded by rows, or replicated.

    Returns:
        The same tree of `jax.Array`s. Rows are split evenly over `"batch"`
        when they divide by the device count; otherwise (a final partial
        batch) every device holds all rows, which keeps the step exact.
    """
    divisible = batch_rows(batch) % mesh_lib.num_devices(mesh) == 0
    sharding = mesh_lib.batch_sharded(mesh) if divisible else mesh_lib.replicated(mesh)
    return jax.device_put(batch, sharding)


def make_batches(x, y=None, sample_weight=None, *, batch_size=None, shuffle=False,
                 seed=0, num_devices=1):
    """Wrap user data as `Batches`, validating what can be checked up front.

    Args:
        x: arrays (with `y`), a `(x, y[, sample_weight])` tuple, a
            `tf.data.Dataset` of batches, or a re-iterable of batches.
        y, sample_weight: arrays, only with array `x`.
        batch_size: global rows per step for arrays (default 32, as in
            Keras); must be `None` for datasets, which are batched already.
        shuffle: reshuffle array rows every epoch (seeded by `seed`).
        seed: seed of the shuffle order; the same seed gives the same order.
        num_devices: devices the global batch is split over.

    Raises:
        ValueError: a `batch_size` smaller than or not divisible by the
            device count, arrays of different lengths, no rows, or a
            `batch_size` given with a dataset.
    """
    if x is None:
        raise ValueError("No training data: pass x (and y), or a dataset.")
    if _is_array_data(x, y):
        if isinstance(x, tuple) and y is None:
            x, y, sample_weight = unpack(x)
        return ArrayBatches(x, y, sample_weight, batch_size=batch_size,
                            shuffle=shuffle, seed=seed, num_devices=num_devices)
    if y is not None or sample_weight is not None:
        raise ValueError(
            "`y` and `sample_weight` go with array inputs only; a dataset "
            f"carries its own. Received x of type {type(x).__name__} and y."
        )
    if batch_size is not None:
        raise ValueError(
            "Do not pass `batch_size` with a dataset: it is batched already. "
            f"Received: batch_size={batch_size}. Batch the dataset itself "
            "(for tf.data, `dataset.batch(n)`)."
        )
    return IterableBatches(x, num_devices=num_devices)


class ArrayBatches:
    """Batches sliced from in-memory arrays, the last one partial if needed."""

    def __init__(self, x, y, sample_weight, *, batch_size, shuffle, seed, num_devices):
        arrays = jax.tree.map(np.asarray, (x, y, sample_weight))
        self.num_samples = batch_rows(arrays)
        if self.num_samples == 0:
            raise ValueError("The data has no rows. Pass at least one sample.")
        self.batch_size = 32 if batch_size is None else int(batch_size)
        _check_global_batch(self.batch_size, num_devices)
        self._arrays, self._shuffle, self._seed = arrays, shuffle, seed

    @property
    def steps(self):
        """Batches per epoch, the partial last one included."""
        return -(-self.num_samples // self.batch_size)

    def peek(self):
        """The first batch, without consuming anything."""
        return next(iter(self.epoch(0)))

    def epoch(self, epoch):
        """Yield this epoch's host batches; every row exactly once."""
        order = None
        if self._shuffle:
            order = np.random.default_rng([self._seed, epoch]).permutation(
                self.num_samples
            )
        for start in range(0, self.num_samples, self.batch_size):
            rows = slice(start, start + self.batch_size)
            if order is not None:
                rows = order[rows]
            yield jax.tree.map(lambda array: array[rows], self._arrays)


class IterableBatches:
    """Batches from a `tf.data.Dataset` or any iterable, one pass per epoch.

    A one-shot iterator (a generator) gives one epoch; a later epoch that
    yields nothing raises a clear error instead of silently training on
    nothing.
    """

    def __init__(self, source, *, num_devices):
        if not hasattr(source, "__iter__"):
            raise TypeError(
                "Training data must be arrays, a tf.data.Dataset or an "
                f"iterable of batches. Received: {type(source).__name__}."
            )
        self._source = _as_numpy_iterable(source)
        self._num_devices = num_devices
        self._first = None
        self._replay = None
        self.steps = None
        self.num_samples = None

    def peek(self):
        """The first batch, kept so that a one-shot iterator loses nothing."""
        if self._first is None:
            iterator = iter(self._source)
            first = next(iterator, None)
            if first is None:
                raise ValueError(_empty_message(0))
            self._first = _host_batch(first)
            if iterator is self._source:
                self._replay = self._first
            # The first batch sets the global batch size, like `batch_size`
            # for arrays; later partial batches are run exactly.
            _check_global_batch(batch_rows(self._first), self._num_devices)
        return self._first

    def epoch(self, epoch):
        """Yield this epoch's host batches as `(x, y, sample_weight)`."""
        self.peek()
        source = iter(self._source)
        if self._replay is not None:
            source = itertools.chain([self._replay], source)
            self._replay = None
        count = 0
        for batch in source:
            count += 1
            yield _host_batch(batch)
        if count == 0:
            raise ValueError(_empty_message(epoch))


def _host_batch(batch):
    return jax.tree.map(np.asarray, unpack(batch))


def _as_numpy_iterable(source):
    # Checking the class's module keeps TensorFlow unimported for users who
    # never pass a tf.data.Dataset.
    if type(source).__module__.startswith("tensorflow") and hasattr(
        source, "as_numpy_iterator"
    ):
        hide_gpus_from_tensorflow()
        return _TFEpochs(source)
    return source


class _TFEpochs:
    """A tf.data.Dataset as a re-iterable of numpy batches."""

    def __init__(self, dataset):
        self._dataset = dataset

    def __iter__(self):
        return self._dataset.as_numpy_iterator()


def hide_gpus_from_tensorflow():
    """Keep TensorFlow (used for tf.data only) off every GPU.

    Without this, TensorFlow would reserve most of each GPU's memory for
    itself, leaving JAX to run out.
    """
    import tensorflow as tf

    try:
        tf.config.set_visible_devices([], "GPU")
    except RuntimeError:
        pass  # TensorFlow's devices are initialised already; nothing to do.


def _is_array_data(x, y):
    if isinstance(x, tuple) and y is None:  # a packed (x, y[, sample_weight])
        x = x[0] if x else None
    # A list is several model inputs only beside `y`; alone it is a list of batches.
    return isinstance(x, dict) or hasattr(x, "__array__") or (
        isinstance(x, list) and y is not None
    )


def _check_global_batch(rows, num_devices):
    if rows < num_devices:
        raise ValueError(
            f"A global batch of {rows} rows is smaller than the {num_devices} "
            "devices it is split over, so some devices would get no rows. "
            f"Use a batch size of at least {num_devices} (a multiple of "
            f"{num_devices}), or train on fewer devices."
        )
    if rows % num_devices:
        raise ValueError(
            f"A global batch of {rows} rows does not split evenly over "
            f"{num_devices} devices. Use a batch size that is a multiple of "
            f"{num_devices}, for example {rows - rows % num_devices or num_devices}"
            f" or {rows + num_devices - rows % num_devices}. (Only the last "
            "batch of an epoch may be partial; keras_dp runs it exactly.)"
        )


def _empty_message(epoch):
    return (
        f"The dataset yielded no batches in epoch {epoch}. If it is a "
        "generator or iterator, it is used up after one pass: pass a "
        "re-iterable (a list of batches, a tf.data.Dataset) or arrays instead."
    )
