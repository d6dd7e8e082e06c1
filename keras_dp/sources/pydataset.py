"""`keras.utils.PyDataset` as a source: its batches by index, its hooks where `model.fit` calls them."""

import collections
import concurrent.futures
import itertools

import numpy as np

from keras_dp import _messages
from keras_dp.sources.source import Replayable


class PyDatasetEpochs:
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
        """The dataset's batches per pass (its `num_batches`), or None: endless."""
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
            self._first_pass = Replayable(self._pass(0))
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
        _messages.warn(
            f"keras_dp reads this PyDataset (workers={dataset.workers}, "
            f"use_multiprocessing=True) in {threads} of this process, not in "
            "processes: a process forked from one running JAX can deadlock. The "
            "batches and their order are the same. To read in processes, use a "
            "grain.DataLoader with worker_count=N.")
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
