"""Datasets and iterables as batches: tf.data, Grain, `keras.utils.PyDataset`, any iterable."""

import collections
import collections.abc as collections_abc
import concurrent.futures
import itertools
import warnings

import jax
import keras
import numpy as np

from keras_dp.sources import grain as grain_source
from keras_dp.sources.batch import VALIDATION
from keras_dp.sources.batch import apply_class_weight
from keras_dp.sources.batch import batch_rows
from keras_dp.sources.batch import check_dtypes
from keras_dp.sources.batch import short_list
from keras_dp.sources.batch import unpack


class IterableBatches:
    """Batches from a `tf.data.Dataset` or any iterable, one pass per epoch.

    Every batch is checked as it arrives against the first: the same
    structure (x, y, sample_weight and their nesting), at least one row,
    and one row count across its arrays. A one-shot iterator (a generator)
    gives one epoch; a later epoch that yields nothing raises a clear error
    instead of silently training on nothing.
    """

    def __init__(self, source, *, class_weight=None, shuffle=False, seed=0, what="The data"):
        if not hasattr(source, "__iter__"):
            raise TypeError(
                f"{what} must be arrays, a tf.data.Dataset or an "
                f"iterable of batches. Received: {type(source).__name__}."
            )
        self._source = _as_numpy_iterable(source, shuffle, seed)
        self._what = f"{what}, {_kind(source)},"
        # A batch's messages name validation data as such; training's read
        # "Batch 3 of epoch 1" alone.
        self._of = " of the validation data" if what == VALIDATION else ""
        self.reiterable = not isinstance(self._source, collections_abc.Iterator)
        self._class_weight = class_weight
        self._first = None
        self._replay = None
        self._structure = self._structured = None
        # Batches per pass, known for a PyDataset (its len) and a
        # tf.data.Dataset (its cardinality, where known), so the progress bar
        # has a total, callbacks' `params["steps"]` is Keras's, and
        # `pipeline.StepsPerEpoch` can warn of epochs that span passes.
        self.steps = getattr(self._source, "num_batches", None)
        # What never ends without `steps_per_epoch` (see `pipeline.check_ends`), or None.
        self.endless = _endless(self._source)
        self.num_samples = None
        self.labels_checked = False
        self._label_check = None

    def read_first_as_keras(self, peeks, resets):
        """Read the first batch (`peek`) as Keras's `fit`, `evaluate` or `predict` reads one.

        `peeks`: Keras reads a batch to build from, from a pass of its own
        (`build.keras_reads_a_batch_to_build`). Where it does not, the pass
        `peek` starts is kept and is the first epoch's: a tf.data pipeline
        draws a new order per pass read (see `_TFEpochs`). `resets`: Keras
        ends a pass before the first epoch (`EpochIterator.reset`, in `fit`
        and `evaluate` always, in `predict` after a build read), calling a
        PyDataset's `on_epoch_end` (see `_PyDatasetEpochs`); `"each pass"`:
        before every pass, as `fit`'s validation (an `evaluate` per
        validation) does. Call before `peek`.
        """
        if isinstance(self._source, (_TFEpochs, _PyDatasetEpochs)) and self._first is None:
            self._source.share_first_pass = not peeks
        if isinstance(self._source, _PyDatasetEpochs):
            self._source.resets = bool(resets)
            self._source.resets_each_pass = resets == "each pass"

    @property
    def epoch_hooks(self):
        """A PyDataset's hooks where `StepsPerEpoch` or `FirstSteps` call them, else None."""
        return getattr(self._source, "epoch_hooks", None)

    def hooks_outside(self):
        """Leave a PyDataset's hooks to whoever reads it for a step count (`epoch_hooks`).

        `model.fit` calls them around each epoch of `steps_per_epoch` steps,
        or each `evaluate` of `steps`, not around each pass.
        """
        if isinstance(self._source, _PyDatasetEpochs):
            self._source.hooks_outside = True

    def peek(self):
        """The first batch, kept so that a one-shot iterator loses nothing."""
        if self._first is None:
            read_first = getattr(self._source, "read_first", None)  # a PyDataset's
            first = read_first() if read_first else next(iter(self._source), None)
            if first is None:
                raise ValueError(_empty_message(self._what))
            self._first = self._host_batch(first, 0, 0)
            if not self.reiterable:
                self._replay = self._first
        return self._first

    def check_labels(self, check, what):
        """Run `check(y, where)` (`keras_dp.checks.labels`) on every batch's labels as it arrives.

        The first batch, read already, is checked now.
        """
        self._label_check = None if check is None else (
            lambda y, index, epoch: check(y, f"batch {index} of epoch {epoch + 1} of {what}"))
        self.labels_checked = True
        if self._label_check is not None and self._first is not None:
            self._label_check(self._first[1], 0, 0)

    def epoch(self, epoch, skip=0):
        """Yield this epoch's host batches as `(x, y, sample_weight)`, from batch `skip` on.

        A Grain source restored from a checkpoint continues from its saved
        position (`grain_source.GrainEpochs.resume`); any other source is
        read from the start and its first `skip` batches dropped.
        """
        self.peek()
        resume = getattr(self._source, "resume", None)
        if resume is not None:
            return self._read(resume(epoch, skip), epoch, skip)
        passes = getattr(self._source, "epoch", None)  # a PyDataset's order depends on it
        iterator = iter(self._source) if passes is None else passes(epoch)
        return itertools.islice(self._read(iterator, epoch, 0), skip, None)

    @property
    def resumable(self):
        """The source whose position a checkpoint saves (a Grain one), or None."""
        return self._source if isinstance(self._source, grain_source.GrainEpochs) else None

    def _read(self, iterator, epoch, first):
        count = first
        if self._replay is not None:
            replay, self._replay = self._replay, None
            count += 1
            yield replay
        for batch in iterator:
            yield self._host_batch(batch, count, epoch)
            count += 1
        if count == 0:
            raise ValueError(_empty_message(self._what, epoch))

    def _host_batch(self, batch, index, epoch):
        batch = jax.tree.map(np.asarray, unpack(batch))
        where = f"Batch {index} of epoch {epoch + 1}{self._of}"
        structure = jax.tree.structure(batch)
        if self._structure is None:
            self._structure, self._structured = structure, batch
        elif structure != self._structure:
            raise ValueError(
                f"{where} has a different structure from the first batch: "
                f"{_structure_change(batch, self._structured)}. Every batch must hold "
                "the same x, y and sample_weight arrays in the same nesting."
            )
        check_dtypes(batch, where)
        _check_batched(batch, where)
        if batch_rows(batch) == 0:
            raise ValueError(
                f"{where} has no rows. Every batch needs at least one sample; "
                "drop empty batches from the dataset (for tf.data, "
                "`dataset.filter(lambda x, *rest: tf.shape(x)[0] > 0)`)."
            )
        if self._label_check is not None:
            self._label_check(batch[1], index, epoch)
        if self._class_weight is not None:
            batch = apply_class_weight(batch, self._class_weight)
        return batch


def _check_batched(batch, where):
    """Raise a `ValueError` when `batch` is one sample: a 0-d array, or arrays that disagree on rows."""
    shapes = [np.shape(leaf) for leaf in jax.tree.leaves(batch)]
    if any(len(shape) == 0 for shape in shapes):
        raise ValueError(
            f"{where} is a single sample, not a batch: its arrays have shapes "
            f"{shapes}, and a 0-d array (one label) has no batch dimension. "
            "keras_dp, like model.fit, reads a dataset as batches. Batch it: "
            "`dataset.batch(64)` for a tf.data.Dataset; a generator or "
            "PyDataset yields arrays with the batch first, such as x of "
            "shape (64, 28, 28, 1) and y of shape (64,)."
        )
    if len({shape[0] for shape in shapes}) > 1:
        raise ValueError(
            f"{where} has arrays without the same number of rows (their first "
            f"dimension): shapes {short_list(shapes)}. If each is one sample, the "
            "dataset is not batched: batch it, `dataset.batch(64)` (tf.data's "
            "`from_tensor_slices`, and `image_dataset_from_directory` and its kin "
            "with batch_size=None, give single samples). Otherwise x, y and "
            "sample_weight must hold one row per sample each."
        )


def _as_numpy_iterable(source, shuffle=False, seed=0):
    # Checking the class's module keeps TensorFlow unimported for users who
    # never pass a tf.data.Dataset.
    if type(source).__module__.startswith("tensorflow") and hasattr(
        source, "as_numpy_iterator"
    ):
        hide_gpus_from_tensorflow()
        return _TFEpochs(source)
    if isinstance(source, keras.utils.PyDataset):
        return _PyDatasetEpochs(source, shuffle, seed)
    if grain_source.is_grain(source):
        return grain_source.GrainEpochs(source)
    return source


class _TFEpochs:
    """A tf.data.Dataset as a re-iterable of numpy batches.

    Ragged batches (`ragged_batch`, or `tf.strings.split` after `batch`) are
    padded with zeros to their longest row, as Keras's `model.fit` pads them
    (`RaggedTensor.to_tensor()`), inside the pipeline.

    A pipeline that reshuffles (`shuffle(..., reshuffle_each_iteration=True)`,
    the default) draws a new order at each iterator made, seeded or not.
    `model.fit` makes one per epoch, and before them one for a first batch
    to build from only while the model (or its compiled loss or metrics) is
    unbuilt; a fit on a built model, a second fit on the same dataset,
    reads its first epoch from the first iterator. keras_dp always reads a
    first batch (`peek`): with `share_first_pass` set, as `model.fit` on a
    built model, that iterator is kept and the first pass goes on from it,
    so no order is drawn that Keras does not draw. Epoch e reads the
    (e + 2)-th order (the (e + 1)-th when shared); `epoch(e)` keeps it so
    when the fit starts at epoch e (a resume, `initial_epoch`): it makes and
    drops the iterators of the epochs before, so a run resumed mid-epoch
    skips the very batches the interrupted run trained on.
    """

    def __init__(self, dataset):
        import tensorflow as tf

        self._dataset = _ragged_to_dense(dataset)
        cardinality = int(dataset.cardinality())
        infinite = cardinality == tf.data.INFINITE_CARDINALITY
        self.endless = "a tf.data.Dataset that repeats forever" if infinite else None
        # Batches per pass where tf.data knows them (not after `filter`), else
        # None: as Keras's adapter, for the progress bar and callbacks' `params`.
        self.num_batches = cardinality if cardinality >= 0 else None
        self.share_first_pass = False
        self._made = 0  # iterators made so far
        self._first_pass = None  # the first iterator, kept when shared

    def __iter__(self):
        self._made += 1
        iterator = self._dataset.as_numpy_iterator()
        if self.share_first_pass and self._made == 1:
            self._first_pass = _Replayable(iterator)
            return self._first_pass
        return iterator

    def epoch(self, epoch):
        """Epoch `epoch`'s pass: the first iterator's (when shared) or the one after it, plus one per epoch before."""
        first_pass, self._first_pass = self._first_pass, None
        if epoch == 0 and first_pass is not None:
            return first_pass.replay()
        while self._made < epoch + (not self.share_first_pass):  # made and dropped
            iter(self)  # unread: each draws its order
        return iter(self)


class _Replayable:
    """An iterator that keeps what was read from it, to read its pass again from the start."""

    def __init__(self, iterator):
        self._iterator = iterator
        self._read = []

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self._iterator)
        self._read.append(item)
        return item

    def replay(self):
        """Return the whole pass: the items read so far, then the rest."""
        return itertools.chain(self._read, self._iterator)


class _PyDatasetEpochs:
    """A `keras.utils.PyDataset`, one pass per epoch.

    With `shuffle` (`fit`'s default, as under `model.fit`) and a known
    length, the batches are read in a new order each epoch, a permutation
    of the indices fixed by `seed` and the epoch (so a resumed run reads
    the order of an unbroken one); otherwise in index order. Keras shuffles
    with Python's unseeded `random`, so its order differs. With `workers > 1`
    the batches are read ahead by that many threads (at most
    `max_queue_size` ahead, as Keras's enqueuer) and handed out in order,
    so the steps are those of one thread; `use_multiprocessing` reads them
    in threads too, with a warning (a process forked from one running JAX
    can deadlock).

    The dataset's `on_epoch_begin` and `on_epoch_end` are called where
    `model.fit` calls them, so per-epoch reshuffling inside it works: around
    each pass; or, for an endless one (`num_batches` None) or one read for
    a fixed number of steps (`hooks_outside`), around each epoch that
    `StepsPerEpoch` or `FirstSteps` reads (they call this object's
    `on_epoch_begin` and `on_epoch_end`: it is their `epoch_hooks`). Before
    the first epoch, `read_first` reads the first batch as Keras does:
    Keras's `fit` and `evaluate` call `on_epoch_end` once before their first
    epoch (`EpochIterator.reset`), after a pass of their own to build from
    while the model is unbuilt (`share_first_pass` False: `on_epoch_begin`,
    a batch, then that `on_epoch_end`); `predict` calls it only after such
    a pass (`resets`), and `fit`'s validation before each of its passes
    (`resets_each_pass`). Where Keras builds from no batch, the first
    epoch's pass starts early and goes on from it.
    """

    def __init__(self, dataset, shuffle=False, seed=0):
        self._dataset = dataset
        self._shuffle = shuffle
        self._seed = seed
        self._workers = _pydataset_workers(dataset)
        self.share_first_pass = False  # as Keras on an unbuilt model
        self.resets = True
        self.resets_each_pass = False
        self.hooks_outside = False
        self._first_pass = None  # the first epoch's pass, started by `read_first`
        self._begun = 0  # epochs begun
        self._begun_early = False

    @property
    def num_batches(self):
        return self._dataset.num_batches

    @property
    def epoch_hooks(self):
        """This object, if whoever counts the epochs calls the hooks around them, else None."""
        return self if self.hooks_outside or self.num_batches is None else None

    def on_epoch_begin(self):
        """The dataset's `on_epoch_begin`, after its `on_epoch_end` under `resets_each_pass`."""
        if self._begun_early:  # by `read_first`
            self._begun_early = False
            return
        self._begun += 1
        if self.resets_each_pass and self._begun > 1:
            self._dataset.on_epoch_end()
        self._dataset.on_epoch_begin()

    def on_epoch_end(self):
        """The dataset's `on_epoch_end`."""
        self._dataset.on_epoch_end()

    def __iter__(self):
        return self.epoch(0)

    def read_first(self):
        """The first batch (or None), read with the hooks Keras calls before its first epoch."""
        if self.share_first_pass:
            if self.resets:
                self._dataset.on_epoch_end()
            if self.epoch_hooks is not None:  # the first epoch begins before its first read
                self.on_epoch_begin()
                self._begun_early = True
            self._first_pass = _Replayable(self._pass(0))
            return next(self._first_pass, None)
        self._dataset.on_epoch_begin()
        first = next(self._pass(0, hooks=False), None)
        if self.resets:
            self._dataset.on_epoch_end()
        return first

    def epoch(self, epoch):
        """Epoch `epoch`'s batches in its order: for the first, the pass `read_first` began."""
        first_pass, self._first_pass = self._first_pass, None
        if first_pass is not None:
            if epoch == 0:
                return first_pass.replay()
            if self.epoch_hooks is None:  # a fit from a later epoch ends the pass begun
                self.on_epoch_end()
        return self._pass(epoch)

    def _pass(self, epoch, hooks=True):
        """Yield epoch `epoch`'s batches, between the hooks where they are called here (`hooks`)."""
        count = self.num_batches
        # No length: an endless dataset, for use with `steps_per_epoch`.
        if count is None:
            yield from self._read(itertools.count())
            return
        hooks = hooks and self.epoch_hooks is None
        if hooks:
            self.on_epoch_begin()
        if self._shuffle:
            indices = np.random.default_rng([self._seed, epoch]).permutation(count).tolist()
        else:
            indices = range(count)
        yield from self._read(indices)
        if hooks:
            self.on_epoch_end()

    def _read(self, indices):
        """`dataset[index]` for each index, in order: here, or read ahead by the workers."""
        if self._workers <= 1:
            return (self._dataset[index] for index in indices)
        depth = max(self._workers, self._dataset.max_queue_size or 1)
        return _read_ahead(self._dataset.__getitem__, indices, self._workers, depth)


def _pydataset_workers(dataset):
    """The threads that read `dataset` (its `workers`), warning if it asks for processes."""
    workers = max(int(dataset.workers or 1), 1)
    if dataset.use_multiprocessing:
        threads = f"{workers} threads" if workers > 1 else "this thread"
        warnings.warn(
            f"keras_dp reads this PyDataset (workers={dataset.workers}, "
            f"use_multiprocessing=True) in {threads} of this process, not in "
            "processes: a process forked from one running JAX can deadlock. The "
            "batches and their order are the same. To read in processes, use a "
            "grain.DataLoader with worker_count=N.", stacklevel=2)
    return workers


def _read_ahead(read, indices, workers, depth):
    """Yield `read(index)` for each of `indices` in order, computed up to `depth` ahead by `workers` threads.

    An exception in `read` is raised at its index. Closing the generator
    cancels what has not started and waits for what has.
    """
    indices = iter(indices)
    pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="keras_dp-pydataset")
    try:
        pending = collections.deque(pool.submit(read, index)
                                    for index in itertools.islice(indices, depth))
        while pending:
            batch = pending.popleft().result()
            pending.extend(pool.submit(read, index) for index in itertools.islice(indices, 1))
            yield batch
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _endless(source):
    """What `source` is if it never ends (for `pipeline.check_ends`), else None.

    Known from the source itself, without reading it: a tf.data.Dataset of
    infinite cardinality (`repeat()`), a PyDataset without a length, a
    Grain pipeline with an endless `repeat()` or sampler.
    """
    if isinstance(source, _TFEpochs):
        return source.endless
    if isinstance(source, _PyDatasetEpochs) and source.num_batches is None:
        return "a keras.utils.PyDataset whose num_batches is None"
    if isinstance(source, grain_source.GrainEpochs):
        return source.endless
    return None


def _ragged_to_dense(dataset):
    """`dataset` with each `tf.RaggedTensor` padded with zeros to a dense tensor."""
    import tensorflow as tf

    if not any(isinstance(spec, tf.RaggedTensorSpec)
               for spec in tf.nest.flatten(dataset.element_spec)):
        return dataset

    def dense(*parts):  # tf.data passes a tuple's parts as arguments
        parts = tf.nest.map_structure(
            lambda part: part.to_tensor() if isinstance(part, tf.RaggedTensor) else part, parts)
        return parts if len(parts) > 1 else parts[0]

    return dataset.map(dense)


def hide_gpus_from_tensorflow():
    """Keep TensorFlow (used for tf.data only) off every GPU.

    Without this, TensorFlow would reserve most of each GPU's memory for
    itself, leaving JAX to run out.
    """
    try:
        import tensorflow as tf
    except ImportError:
        raise ImportError(
            "tf.data input needs TensorFlow, which keras_dp installs only "
            "with its `tf` extra: pip install 'keras_dp[tf]'."
        ) from None

    try:
        tf.config.set_visible_devices([], "GPU")
    except RuntimeError:  # TensorFlow's devices are initialised already
        if tf.config.list_logical_devices("GPU"):
            warnings.warn(
                "TensorFlow started before keras_dp could hide the GPUs from it, "
                "and it holds them: it may have reserved most of their memory, "
                "leaving JAX to run out. Import keras_dp before running "
                "TensorFlow code, or call tf.config.set_visible_devices([], 'GPU') "
                "first.", stacklevel=3)


def _empty_message(what, epoch=None):
    """Why `what` stopped short: empty at its first batch (`epoch` None), or used up by `epoch`."""
    if epoch is None:  # its first pass: nothing to train, score or predict on at all
        return (
            f"{what} yielded no batches: it is empty, and "
            "keras_dp, like model.fit, needs at least one batch. Check what "
            "empties it: a filter that drops every element, take(0), a skip past "
            "its end, batch(n, drop_remainder=True) with n above its size, an "
            "empty list or PyDataset, or a generator already read to its end."
        )
    return (
        f"{what} yielded no batches in epoch {epoch + 1}. If it is a "
        "generator or iterator, it is used up after one pass: pass a "
        "re-iterable (a list of batches, a tf.data.Dataset) or arrays instead."
    )


def _kind(source):
    """What `source` is, as a message names it: "a tf.data.Dataset", "a generator", "a list"."""
    if type(source).__module__.startswith("tensorflow"):
        return "a tf.data.Dataset"
    if isinstance(source, keras.utils.PyDataset):
        return "a keras.utils.PyDataset"
    if isinstance(source, collections_abc.Generator):
        return "a generator"
    if type(source).__module__.startswith("grain"):
        return f"a Grain {type(source).__name__}"
    return f"a {type(source).__name__}"


def _structure_change(batch, first):
    """Where `batch`'s (x, y, sample_weight) nesting first differs from `first`'s, in words."""
    for name, now, before in zip(("x", "y", "sample_weight"), batch, first, strict=True):
        if jax.tree.structure(now) != jax.tree.structure(before):
            return (f"its {name} is {_describe(now)}, where the first batch's was "
                    f"{_describe(before)}")
    return f"{jax.tree.structure(batch)} instead of {jax.tree.structure(first)}"


def _describe(tree):
    """`tree` in words: "an array", "a tuple of 2 arrays", "a dict with keys ['a', 'b']"."""
    if tree is None:
        return "absent (None)"
    if isinstance(tree, dict):
        return f"a dict with keys {short_list(sorted(map(str, tree)))}"
    if isinstance(tree, (list, tuple)):
        kinds = [_describe(item) for item in tree]
        if all(kind == "an array" for kind in kinds):
            return f"a {type(tree).__name__} of {len(tree)} arrays"
        return f"a {type(tree).__name__} of {len(tree)}: {', '.join(kinds)}"
    return "an array"

