"""The input pipeline: user data to host batches to sharded device batches.

keras_dp accepts what `model.fit` accepts most often: numpy arrays (`x`, `y`,
`sample_weight`; `x` may be a dict or list of arrays), a `(x, y)` or
`(x, y, sample_weight)` tuple of arrays, a `tf.data.Dataset` of batches, or
any re-iterable of such batches. Each becomes a `Batches` object that yields
host batches `(x, y, sample_weight)` of numpy arrays, epoch after epoch.

Any global batch goes on the devices, whatever its size: `to_device` pads
its rows (repeating the last row) to a multiple of the device count, the
only split `jax.device_put` accepts, and records the real row count as a
static part of the `DeviceBatch`. Inside a compiled step, `real_rows` cuts
the padding off again, so the model, its loss, BatchNorm's batch statistics
and the metrics all see exactly the real rows, split unevenly over the
devices: XLA's SPMD partitioner masks the missing rows out of every
reduction. No row is dropped, none is invented, and no model needs a mask.
"""

import collections.abc as collections_abc
import dataclasses
import itertools
import queue
import threading
import warnings

import jax
import jax.numpy as jnp
import keras
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


@dataclasses.dataclass(frozen=True)
class DeviceBatch:
    """A global batch on the mesh, its rows padded to split evenly.

    Attributes:
        data: the batch's tree of `jax.Array`s; each has `rows` real rows
            followed by copies of the last one, up to the next multiple of
            the device count, sharded along `"batch"`.
        rows: the number of real rows. It is static under `jax.jit`, so a
            step compiles once per distinct row count and reuses that
            program in every later epoch.
        blocks: `None` when the real rows are the first `rows` rows (always
            so on one process). Across processes (`keras_dp.distributed`),
            the batch is one block of equal length per process, each its
            real rows then padding; `blocks` is then the tuple of each
            block's real row count, in mesh order, also static.
    """

    data: object
    rows: int
    blocks: tuple | None = None


jax.tree_util.register_dataclass(
    DeviceBatch, data_fields=["data"], meta_fields=["rows", "blocks"]
)


def to_device(batch, mesh):
    """Place a host batch (any tree of arrays) on `mesh`, split by rows.

    Returns:
        A `DeviceBatch`. Padding repeats the last real row, so that the
        padded rows are values the model already handles; they never reach
        a result (see `real_rows`).

    Raises:
        ValueError: a batch without rows.
    """
    rows = batch_rows(batch)
    if rows == 0:
        raise ValueError(
            "A batch with no rows cannot be placed: a step needs at least one "
            "sample. Check the slice that made it (for example x[start:stop] "
            "past the end of the data)."
        )
    batch = _pad(batch, rows, mesh)
    return DeviceBatch(jax.device_put(batch, mesh_lib.batch_sharded(mesh)), rows)


def to_device_stacked(batches, mesh):
    """Place K host batches of equal row count on `mesh` as one stack.

    Returns:
        A `DeviceBatch` whose arrays have shape `[K, padded_rows, ...]`,
        sharded `PartitionSpec(None, "batch")`: every device holds its rows
        of all K batches, for a multi-step program to scan over.
    """
    rows = batch_rows(batches[0])
    if any(batch_rows(batch) != rows for batch in batches):
        raise ValueError(f"Stacked batches must all have {rows} rows.")
    padded = [_pad(batch, rows, mesh) for batch in batches]
    stack = jax.tree.map(lambda *arrays: np.stack(arrays), *padded)
    return DeviceBatch(jax.device_put(stack, mesh_lib.stacked_batch_sharded(mesh)), rows)


def _pad(batch, rows, mesh):
    return pad_rows(batch, rows + -rows % mesh_lib.num_devices(mesh))


def pad_rows(batch, size):
    """`batch` grown to `size` rows with copies of its last row."""
    def pad(array):
        extra = size - array.shape[0]
        return np.concatenate([array, np.repeat(array[-1:], extra, axis=0)]) if extra else array

    return jax.tree.map(pad, batch)


def real_rows(batch, mesh):
    """Inside a compiled step: the real rows of a `DeviceBatch`.

    The padding is cut off and the rows stay split over `"batch"` (unevenly
    when they do not divide), so every computation that follows, means and
    BatchNorm statistics included, is over exactly the real rows.
    """
    sharding = mesh_lib.batch_sharded(mesh)
    return jax.tree.map(
        lambda array: jax.lax.with_sharding_constraint(_cut(array, batch), sharding),
        batch.data,
    )


def _cut(array, batch):
    if batch.blocks is None:
        return array[: batch.rows]
    # Static slices of each process's block, joined: the shapes stay static
    # and XLA moves rows between devices where the blocks' padding differs.
    size = array.shape[0] // len(batch.blocks)
    parts = [array[i * size:i * size + real] for i, real in enumerate(batch.blocks) if real]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def restore_rows(array, batch):
    """Inside a compiled step: the inverse of `real_rows` for an output.

    Puts each real row back where its input row was, zeros in the padding,
    so an output has the input batch's padded layout (for `predict`).
    """
    padded = jax.tree.leaves(batch.data)[0].shape[0]
    tail = [(0, 0)] * (array.ndim - 1)
    if batch.blocks is None:
        return jnp.pad(array, [(0, padded - batch.rows)] + tail)
    size = padded // len(batch.blocks)
    parts, start = [], 0
    for real in batch.blocks:
        parts.append(jnp.pad(array[start:start + real], [(0, size - real)] + tail))
        start += real
    return jnp.concatenate(parts)


def make_batches(x, y=None, sample_weight=None, *, batch_size=None, shuffle=False,
                 seed=0, class_weight=None):
    """Wrap user data as `Batches`, validating what can be checked up front.

    Args:
        x: arrays (with `y`), a `(x, y[, sample_weight])` tuple, a
            `tf.data.Dataset` of batches, or a re-iterable of batches.
        y, sample_weight: arrays, only with array `x`.
        batch_size: global rows per step for arrays (default 32, as in
            Keras), any positive number whatever the device count; must be
            `None` for datasets, which are batched already.
        shuffle: reshuffle array rows every epoch (seeded by `seed`).
        seed: seed of the shuffle order; the same seed gives the same order.
        class_weight: `{class_id: weight}`, turned into per-sample weights
            from the labels as `model.fit` does (integer ids, or the argmax
            of one-hot rows); classes not listed weigh 1.

    Raises:
        ValueError: arrays of different lengths or of a non-numeric dtype,
            no rows, a `batch_size` below 1 or given with a dataset, or
            `class_weight` with `sample_weight` or with several outputs.
    """
    if x is None:
        raise ValueError("No training data: pass x (and y), or a dataset.")
    if _is_array_data(x, y):
        if isinstance(x, tuple) and y is None:
            x, y, sample_weight = unpack(x)
        return ArrayBatches(x, y, sample_weight, batch_size=batch_size,
                            shuffle=shuffle, seed=seed, class_weight=class_weight)
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
    return IterableBatches(x, class_weight=class_weight)


def split_validation(x, y, sample_weight, validation_split):
    """Split off the last `validation_split` of array data, as `model.fit` does.

    The split is taken before any shuffling, so the validation rows are the
    same every epoch and in every run.

    Returns:
        `((x, y, sample_weight), (x_val, y_val, sample_weight_val))`.

    Raises:
        ValueError: a fraction outside (0, 1), data that is not arrays, or
            a split that leaves either part without rows.
    """
    if not 0 < validation_split < 1:
        raise ValueError(
            "`validation_split` is the fraction of rows held out, between 0 "
            f"and 1. Received: validation_split={validation_split}."
        )
    if not _is_array_data(x, y):
        raise ValueError(
            "`validation_split` works on arrays only; a dataset cannot be "
            "split without reading it. Pass `validation_data=` instead. "
            f"Received x of type {type(x).__name__}."
        )
    if isinstance(x, tuple) and y is None:
        x, y, sample_weight = unpack(x)
    arrays = jax.tree.map(np.asarray, (x, y, sample_weight))
    total = batch_rows(arrays)
    split = int(np.floor(total * (1 - validation_split)))
    if split == 0 or split == total:
        raise ValueError(
            f"`validation_split={validation_split}` of {total} rows leaves "
            f"{split} rows for training and {total - split} for validation; "
            "both need at least one. Use a fraction that splits the data."
        )
    return (
        jax.tree.map(lambda array: array[:split], arrays),
        jax.tree.map(lambda array: array[split:], arrays),
    )


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


class ArrayBatches:
    """Batches sliced from in-memory arrays, the last one partial if needed."""

    reiterable = True

    def __init__(self, x, y, sample_weight, *, batch_size, shuffle, seed, class_weight):
        arrays = jax.tree.map(np.asarray, (x, y, sample_weight))
        _check_dtypes(arrays)
        self.num_samples = batch_rows(arrays)
        if self.num_samples == 0:
            raise ValueError("The data has no rows. Pass at least one sample.")
        self.batch_size = 32 if batch_size is None else int(batch_size)
        if self.batch_size < 1:
            raise ValueError(
                f"`batch_size` must be at least 1. Received: batch_size={batch_size}."
            )
        if class_weight is not None:
            arrays = _apply_class_weight(arrays, class_weight)
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

    Every batch is checked as it arrives against the first: the same
    structure (x, y, sample_weight and their nesting), at least one row,
    and one row count across its arrays. A one-shot iterator (a generator)
    gives one epoch; a later epoch that yields nothing raises a clear error
    instead of silently training on nothing.
    """

    def __init__(self, source, *, class_weight=None):
        if not hasattr(source, "__iter__"):
            raise TypeError(
                "Training data must be arrays, a tf.data.Dataset or an "
                f"iterable of batches. Received: {type(source).__name__}."
            )
        self._source = _as_numpy_iterable(source)
        self.reiterable = not isinstance(self._source, collections_abc.Iterator)
        self._class_weight = class_weight
        self._first = None
        self._replay = None
        self._structure = None
        # Known for a PyDataset (its len), so the progress bar has a total.
        self.steps = getattr(self._source, "num_batches", None)
        self.num_samples = None

    def peek(self):
        """The first batch, kept so that a one-shot iterator loses nothing."""
        if self._first is None:
            iterator = iter(self._source)
            first = next(iterator, None)
            if first is None:
                raise ValueError(_empty_message(0))
            self._first = self._host_batch(first, 0, 0)
            if not self.reiterable:
                self._replay = self._first
        return self._first

    def epoch(self, epoch):
        """Yield this epoch's host batches as `(x, y, sample_weight)`."""
        self.peek()
        count = 0
        if self._replay is not None:
            replay, self._replay = self._replay, None
            count += 1
            yield replay
        for batch in iter(self._source):
            yield self._host_batch(batch, count, epoch)
            count += 1
        if count == 0:
            raise ValueError(_empty_message(epoch))

    def _host_batch(self, batch, index, epoch):
        batch = jax.tree.map(np.asarray, unpack(batch))
        where = f"Batch {index} of epoch {epoch}"
        structure = jax.tree.structure(batch)
        if self._structure is None:
            self._structure = structure
        elif structure != self._structure:
            raise ValueError(
                f"{where} has a different structure from the first batch: "
                f"{structure} instead of {self._structure}. Every batch must "
                "hold the same x, y and sample_weight arrays in the same nesting."
            )
        _check_dtypes(batch, where)
        if batch_rows(batch) == 0:
            raise ValueError(
                f"{where} has no rows. Every batch needs at least one sample; "
                "drop empty batches from the dataset (for tf.data, "
                "`dataset.filter(lambda x, *rest: tf.shape(x)[0] > 0)`)."
            )
        if self._class_weight is not None:
            batch = _apply_class_weight(batch, self._class_weight)
        return batch


def group_steps(batches, steps_per_execution):
    """Group host batches for execution: lists of K batches of one row count.

    A run of fewer than K batches of one row count (an epoch's end, a
    partial batch) comes out as single-batch lists, for the one-step
    program: every batch is used, in order, and only two programs compile.
    """
    pending = []
    for batch in batches:
        if pending and batch_rows(batch) != batch_rows(pending[0]):
            yield from ([single] for single in pending)
            pending = []
        pending.append(batch)
        if len(pending) == steps_per_execution:
            yield pending
            pending = []
    yield from ([single] for single in pending)


def prefetch(items, depth):
    """Yield `items` in order, produced up to `depth` ahead by a thread.

    The producer (slicing, shuffling, reading tf.data, padding and the copy
    to the devices) then runs while the devices compute the previous step.
    It dispatches no computation, so it does not count against the bound on
    steps in flight. An exception in the producer is raised here, at the
    item where it happened; closing this generator stops the producer.
    `depth=0` produces inline, without a thread.
    """
    if depth <= 0:
        yield from items
        return
    slots = queue.Queue(maxsize=depth)
    stop = threading.Event()
    end = object()

    def offer(entry):
        while not stop.is_set():
            try:
                slots.put(entry, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def produce():
        try:
            for item in items:
                if not offer((item, None)):
                    return
            offer((end, None))
        except BaseException as error:  # noqa: BLE001 - re-raised by the consumer
            offer((None, error))

    threading.Thread(target=produce, name="keras_dp-prefetch", daemon=True).start()
    try:
        while True:
            item, error = slots.get()
            if error is not None:
                raise error
            if item is end:
                return
            yield item
    finally:
        stop.set()


class StepsPerEpoch:
    """Epochs of a fixed number of steps, drawn from one continuing stream.

    Epoch e takes the next `steps` batches. When the data ends, a
    re-iterable source (arrays, a `tf.data.Dataset`, a list) starts a new
    pass, reshuffled for arrays, so an epoch may span two passes. A one-shot
    iterator that runs out ends the epoch early and sets `exhausted`, and
    the trainer stops, as `model.fit` does.
    """

    def __init__(self, batches, steps):
        if int(steps) < 1:
            raise ValueError(
                f"`steps_per_epoch` must be at least 1. Received: {steps}."
            )
        self.steps = int(steps)
        self.exhausted = False
        self._batches = batches
        self._stream = self._passes()

    def peek(self):
        """The first batch of the underlying data."""
        return self._batches.peek()

    def epoch(self, epoch):
        """Yield the next `steps` batches of the stream."""
        for _ in range(self.steps):
            batch = next(self._stream, None)
            if batch is None:
                self.exhausted = True
                warnings.warn(
                    f"The input ran out of data in epoch {epoch}; training "
                    "stops here. Make sure the data can give at least "
                    "`steps_per_epoch * epochs` batches: pass a re-iterable "
                    "(a tf.data.Dataset, a list) or `.repeat()` the dataset.",
                    stacklevel=2,
                )
                return
            yield batch

    def _passes(self):
        for data_pass in itertools.count():
            yield from self._batches.epoch(data_pass)
            if not self._batches.reiterable:
                return


def _apply_class_weight(batch, class_weight):
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


def _check_dtypes(batch, where="The data"):
    for leaf in jax.tree.leaves(batch):
        if leaf.dtype.kind not in "biuf":
            raise ValueError(
                f"{where} has an array of dtype {leaf.dtype} (shape "
                f"{leaf.shape}); keras_dp trains on numeric arrays only. "
                "Convert it to numbers first; ragged sequences become "
                "`object` arrays: pad them to one length "
                "(keras.utils.pad_sequences)."
            )


def _as_numpy_iterable(source):
    # Checking the class's module keeps TensorFlow unimported for users who
    # never pass a tf.data.Dataset.
    if type(source).__module__.startswith("tensorflow") and hasattr(
        source, "as_numpy_iterator"
    ):
        hide_gpus_from_tensorflow()
        return _TFEpochs(source)
    if isinstance(source, keras.utils.PyDataset):
        return _PyDatasetEpochs(source)
    return source


class _TFEpochs:
    """A tf.data.Dataset as a re-iterable of numpy batches."""

    def __init__(self, dataset):
        self._dataset = dataset

    def __iter__(self):
        return self._dataset.as_numpy_iterator()


class _PyDatasetEpochs:
    """A `keras.utils.PyDataset` read in index order, one pass per epoch.

    Calls the dataset's `on_epoch_begin` and `on_epoch_end` around each pass,
    as `model.fit` does, so per-epoch reshuffling inside it works. Batches
    are read in this thread (`workers` and multiprocessing are not used).
    """

    def __init__(self, dataset):
        self._dataset = dataset

    @property
    def num_batches(self):
        return self._dataset.num_batches

    def __iter__(self):
        self._dataset.on_epoch_begin()
        count = self._dataset.num_batches
        # No length: an endless dataset, for use with `steps_per_epoch`.
        indices = range(count) if count is not None else itertools.count()
        for index in indices:
            yield self._dataset[index]
        self._dataset.on_epoch_end()


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


def _empty_message(epoch):
    return (
        f"The dataset yielded no batches in epoch {epoch}. If it is a "
        "generator or iterator, it is used up after one pass: pass a "
        "re-iterable (a list of batches, a tf.data.Dataset) or arrays instead."
    )
