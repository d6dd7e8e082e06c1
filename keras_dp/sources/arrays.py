"""In-memory arrays as a source: sliced, shuffled per epoch, the last batch partial.

Across processes the arrays a process passes are read one of two ways
(`keras_dp.multihost.agreement` decides, in the settings round every fit makes):

- its own share (`keras_dp.distributed.process_share`): sliced into local
  batches of `batch_size / processes` rows and shuffled with an order of
  its own, so which rows a global step takes depends on the process count;
- the whole data, the same on every process (`read_part`): the epoch's
  order and its global batches are one process's, and each process takes
  its part of every global batch: a function of the seed, the epoch and
  the step alone, whatever the number of processes, so a run stopped
  inside an epoch resumes on any number of them.
"""

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
        # `(x, y, sample_weight)` as numpy arrays, class weights applied.
        self.arrays, self._shuffle, self._seed = arrays, shuffle, seed
        self.part = None  # (index, count): this process's part of each global batch
        # The global order of one process; None: each process's share, in an order of its own.
        self.global_order = "arrays"

    def read_part(self, index, count):
        """Read the arrays as the whole data: part `index` of `count` of every global batch.

        Until now `batch_size` was this process's share of a global batch
        (`batch_size / count`); it becomes the global batch again. Part k
        is rows `k * L` to `(k + 1) * L` of each global batch (L = batch_size
        / count, cut at the batch's end, so the last batch's later parts
        may be short or empty), and the parts in mesh order are the global
        batch in the order one process takes it.
        """
        self.batch_size *= count
        self.part, self.global_order = (index, count), "arrays"

    def check_labels(self, check, what):
        """Run `check(y, where)` (`keras_dp.checks.labels`; None: nothing) on all labels, once."""
        if check is not None and not self.labels_checked:
            check(self.arrays[1], what)
        self.labels_checked = True

    @property
    def steps(self):
        """Batches per epoch, the partial last one included."""
        return -(-self.num_samples // self.batch_size)

    def peek(self):
        """The first batch, without consuming anything (its first row, where this part is empty)."""
        first = next(iter(self.epoch(0)), None)
        if first is None:  # a part of no rows: a template of the right structure
            first = jax.tree.map(lambda array: array[:1], self.arrays)
        return first

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
        """Yield this epoch's host batches from batch `skip` on; every row exactly once.

        With a `part`, this process's non-empty parts of the global batches.
        """
        order = self.order(epoch)
        for start, stop in self._spans(skip):
            if stop > start:
                rows = slice(start, stop) if order is None else order[start:stop]
                yield jax.tree.map(lambda array: array[rows], self.arrays)

    def planned_rows(self, skip=0):
        """Each batch's row count in an epoch, after its first `skip`: full batches, then the rest.

        With a `part`, this process's rows of each global batch (0 where its part is empty).
        """
        return [stop - start for start, stop in self._spans(skip)]

    def _spans(self, skip):
        """`(start, stop)` in the epoch's order of each batch this process takes, from batch `skip`."""
        total, size = self.num_samples, self.batch_size
        index, count = self.part or (0, 1)
        local = size // count
        for start in range(skip * size, total, size):
            end = min(start + size, total)
            yield min(start + index * local, end), min(start + (index + 1) * local, end)
