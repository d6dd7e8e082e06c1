"""`Source`: what every source of host batches gives the feeds, the checks and checkpoints.

A source is read one pass at a time (`epoch`), each pass a sequence of
host batches `(x, y, sample_weight)` of numpy arrays. Its other attributes
say what is known about it before reading, each with a default here, so a
reader asks the attribute instead of probing for it or for a class:
arrays (`ArrayBatches`) know their rows and order, a tf.data pipeline or a
PyDataset may know its length or that it never ends, a Grain source can
save its position, and a fixed number of steps per pass
(`keras_dp.sources.stream`) may run a stream dry.
"""

import itertools


class Source:
    """The protocol of a source of host batches, with its defaults.

    Attributes:
        steps: batches per pass, where known before reading; else None.
        reiterable: whether a pass can be read again (False: a generator).
        endless: what the source is, in words, if a pass never ends (a
            tf.data `repeat()`); else None.
        stream: whether its epochs are drawn from one continuing stream
            (`steps_per_epoch`), rather than one pass each.
        exhausted: whether a one-shot stream ran dry (training stops).
        resumable: what a checkpoint saves of its position (a Grain
            source's), or None.
        arrays: `(x, y, sample_weight)` in memory, for arrays; else None.
        num_samples, batch_size: of arrays; else None.
        labels_checked: whether `check_labels` has run.
        epoch_hooks: a PyDataset's hooks, where whoever counts the epochs
            of a fixed number of steps must call them; else None.
        global_order: what makes the rows of an epoch's steps a function of
            the seed, the epoch and the step alone, whatever the number of
            processes (`"arrays"`: arrays read as one process reads them;
            `"grain elastic"`: a Grain `ElasticIterator`); None where each
            process reads a share in an order of its own, or a dataset.
        global_batch_size: a Grain `ElasticIterator`'s global batch; else None.
    """

    steps = None
    reiterable = True
    endless = None
    stream = False
    exhausted = False
    resumable = None
    arrays = None
    num_samples = None
    batch_size = None
    labels_checked = False
    epoch_hooks = None
    global_order = None
    global_batch_size = None

    def epoch(self, epoch, skip=0):
        """Yield epoch `epoch`'s host batches, from its batch `skip` on."""
        raise NotImplementedError

    def peek(self):
        """The first batch, without consuming anything."""
        raise NotImplementedError

    def check_labels(self, check, what):
        """Run `check(y, where)` (`keras_dp.checks.labels`) on the labels, as they come."""
        raise NotImplementedError

    def hooks_outside(self):
        """Leave a PyDataset's hooks to whoever reads it for a count of steps (`epoch_hooks`)."""

    def close(self):
        """Let go of a pass left open (a stream's), and the iterators and threads it holds."""

    def order(self, epoch):
        """The row ids of arrays in epoch `epoch`'s order, or None (unshuffled, or not arrays)."""
        return None

    def planned_rows(self, skip=0):
        """Each coming batch's row count, when known before reading (arrays): a list, or None.

        `skip` drops the first steps, as a resumed epoch does.
        """
        return None


class Replayable:
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
