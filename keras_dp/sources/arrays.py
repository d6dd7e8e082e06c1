"""In-memory arrays as a source: sliced, shuffled per epoch, the last batch partial."""

import jax
import numpy as np

from keras_dp import options
from keras_dp.checks import data as data_checks
from keras_dp.sources.batch import apply_class_weight
from keras_dp.sources.source import Source


class ArrayBatches(Source):
    """Batches sliced from in-memory arrays, the last one partial if needed."""

    def __init__(self, x, y, sample_weight, *, batch_size, shuffle, seed, class_weight,
                 what="The data"):
        arrays = jax.tree.map(np.asarray, (x, y, sample_weight))
        data_checks.check_dtypes(arrays, what)
        self.num_samples = data_checks.array_rows(*arrays, what=what)
        if self.num_samples == 0:
            raise ValueError(f"{what} has no rows. Pass at least one sample.")
        self.batch_size = 32 if batch_size is None else options.check_count("batch_size", batch_size, 1)
        if class_weight is not None:
            arrays = apply_class_weight(arrays, class_weight)
        self._arrays, self._shuffle, self._seed = arrays, shuffle, seed
        self.labels_checked = False

    def check_labels(self, check, what):
        """Run `check(y, where)` (`keras_dp.checks.labels`; None: nothing) on all labels, once."""
        if check is not None and not self.labels_checked:
            check(self._arrays[1], what)
        self.labels_checked = True

    @property
    def steps(self):
        """Batches per epoch, the partial last one included."""
        return -(-self.num_samples // self.batch_size)

    def peek(self):
        """The first batch, without consuming anything."""
        return next(iter(self.epoch(0)))

    @property
    def arrays(self):
        """`(x, y, sample_weight)` as numpy arrays, class weights applied."""
        return self._arrays

    def order(self, epoch):
        """The row ids in epoch `epoch`'s order: a permutation, or `None` unshuffled.

        The permutation is `np.random.default_rng([seed, epoch])`'s, so it
        depends only on the seed and the epoch (`keras_dp.core.feed` sends
        the same one to the devices). With `shuffle="batch"`, as in
        `model.fit`, each batch keeps its rows and its place, and only the
        rows within it are permuted.
        """
        if not self._shuffle:
            return None
        rng = np.random.default_rng([self._seed, epoch])
        if isinstance(self._shuffle, str) and self._shuffle == "batch":
            order = np.arange(self.num_samples)
            for start in range(0, self.num_samples, self.batch_size):
                rows = order[start:start + self.batch_size]  # a view: permuted in place
                rows[:] = rng.permutation(rows)
            return order
        return rng.permutation(self.num_samples)

    def epoch(self, epoch, skip=0):
        """Yield this epoch's host batches from batch `skip` on; every row exactly once."""
        order = self.order(epoch)
        for start in range(skip * self.batch_size, self.num_samples, self.batch_size):
            rows = slice(start, start + self.batch_size)
            if order is not None:
                rows = order[rows]
            yield jax.tree.map(lambda array: array[rows], self._arrays)

    def planned_rows(self, skip=0):
        """Each batch's row count in an epoch, after its first `skip`: full batches, then the rest."""
        total, size = self.num_samples, self.batch_size
        return [min(size, total - start) for start in range(0, total, size)][skip:]
