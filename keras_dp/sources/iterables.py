"""Datasets and iterables as a source: tf.data, Grain, `keras.utils.PyDataset`, any iterable."""

import collections.abc as collections_abc
import itertools

import jax
import keras
import numpy as np

from keras_dp import sharding
from keras_dp._messages import short_list
from keras_dp.checks import data as data_checks
from keras_dp.sources import grain as grain_source
from keras_dp.sources.batch import VALIDATION
from keras_dp.sources.batch import apply_class_weight
from keras_dp.sources.batch import densify
from keras_dp.sources.batch import unpack
from keras_dp.sources.pydataset import PyDatasetEpochs
from keras_dp.sources.source import Source
from keras_dp.sources.tfdata import TFEpochs
from keras_dp.sources.tfdata import hide_gpus_from_tensorflow


class IterableBatches(Source):
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
        # `sources.stream.StepsPerEpoch` can warn of epochs that span passes.
        self.steps = getattr(self._source, "num_batches", None)
        # What never ends without `steps_per_epoch` (see `sources.check_ends`), or None.
        self.endless = _endless(self._source)
        self._label_check = None

    def read_first_as_keras(self, peeks, resets):
        """Read the first batch (`peek`) as Keras's `fit`, `evaluate` or `predict` reads one.

        `peeks`: Keras reads a batch to build from, from a pass of its own
        (`build.keras_reads_a_batch_to_build`). Where it does not, the pass
        `peek` starts is kept and is the first epoch's: a tf.data pipeline
        draws a new order per pass read (see `TFEpochs`). `resets`: Keras
        ends a pass before the first epoch (`EpochIterator.reset`, in `fit`
        and `evaluate` always, in `predict` after a build read), calling a
        PyDataset's `on_epoch_end` (see `PyDatasetEpochs`); `"each pass"`:
        before every pass, as `fit`'s validation (an `evaluate` per
        validation) does. Call before `peek`.
        """
        if isinstance(self._source, (TFEpochs, PyDatasetEpochs)) and self._first is None:
            self._source.share_first_pass = not peeks
        if isinstance(self._source, PyDatasetEpochs):
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
        if isinstance(self._source, PyDatasetEpochs):
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
    def global_order(self):
        """`"grain elastic"` for a Grain `ElasticIterator`, whose position is global; else None."""
        return "grain elastic" if getattr(self._source, "elastic", False) else None

    @property
    def global_batch_size(self):
        """A Grain `ElasticIterator`'s global batch size; else None."""
        return getattr(self._source, "global_batch_size", None)

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
        batch = jax.tree.map(np.asarray, densify(unpack(batch)))
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
        data_checks.check_dtypes(batch, where)
        _check_batched(batch, where)
        if sharding.batch_rows(batch) == 0:
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
        return TFEpochs(source)
    if isinstance(source, keras.utils.PyDataset):
        return PyDatasetEpochs(source, shuffle, seed)
    if grain_source.is_grain(source):
        return grain_source.GrainEpochs(source)
    return source


def _endless(source):
    """What `source` is if it never ends (for `sources.check_ends`), else None.

    Known from the source itself, without reading it: a tf.data.Dataset of
    infinite cardinality (`repeat()`), a PyDataset without a length, a
    Grain pipeline with an endless `repeat()` or sampler.
    """
    if isinstance(source, (TFEpochs, grain_source.GrainEpochs)):
        return source.endless
    if isinstance(source, PyDatasetEpochs) and source.num_batches is None:
        return "a keras.utils.PyDataset whose num_batches is None"
    return None


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

