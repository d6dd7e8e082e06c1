"""Batches in time: epochs of a fixed length, K-step groups, and the look-ahead."""

import itertools
import numbers
import queue
import threading
import warnings

import jax
import numpy as np

from keras_dp.sources import grain as grain_source
from keras_dp.sources.batch import batch_rows
from keras_dp.sources.batch import check_count


class FixedSteps:
    """The base of `StepsPerEpoch` and `FirstSteps`: what they pass through to their data."""

    def peek(self):
        """The first batch of the underlying data."""
        return self._batches.peek()

    @property
    def labels_checked(self):
        """Whether `check_labels` has run (on the underlying data)."""
        return self._batches.labels_checked

    def check_labels(self, check, what):
        """Check the underlying data's labels (see its `check_labels`)."""
        self._batches.check_labels(check, what)

    def _hooks_outside(self):
        """Call a PyDataset's hooks here, around each epoch, not around each pass (`_marked`)."""
        hooks_outside = getattr(self._batches, "hooks_outside", None)
        if hooks_outside is not None:
            hooks_outside()

    def _marked(self, batches):
        """`batches`, between a PyDataset's `on_epoch_begin` and `on_epoch_end`.

        `model.fit` calls both around each epoch (and each evaluation) of a
        fixed number of steps it reads, not around each pass: an endless
        dataset has none. So per-epoch work in them runs, and a dataset
        that reshuffles in `on_epoch_end` does so after each epoch, as under
        `model.fit`. `on_epoch_end` runs once the epoch's last batch is read.
        """
        hooks = getattr(self._batches, "epoch_hooks", None)
        if hooks is None:
            yield from batches
            return
        hooks.on_epoch_begin()
        yield from batches
        hooks.on_epoch_end()


class StepsPerEpoch(FixedSteps):
    """Epochs of a fixed number of steps, drawn from one continuing stream.

    Epoch e takes the next `steps` batches. When the data ends, a
    re-iterable source (arrays, a `tf.data.Dataset`, a list) starts a new
    pass, reshuffled for arrays, so an epoch may span two passes. A one-shot
    iterator that runs out ends the epoch early and sets `exhausted`, and
    the trainer stops, as `model.fit` does. An epoch that would span the end
    of a pass over data of known length, within the `epochs` this fit runs,
    is warned of when made: `model.fit` ends such an epoch early instead.
    """

    def __init__(self, batches, steps, epochs=None):
        self.steps = check_count("steps_per_epoch", steps, 1)
        _warn_if_epochs_span_passes(batches, self.steps, epochs)
        self.exhausted = False
        self._batches = batches
        self._hooks_outside()
        self._stream = None  # started by the first `epoch`
        self._states = {}  # a Grain source's state at each (epoch, steps), while recording

    @property
    def resumable(self):
        """The stream's position for checkpoints, for a Grain source; else None."""
        epochs = getattr(self._batches, "resumable", None)
        return None if epochs is None else grain_source.StreamPosition(epochs, self._states)

    def epoch(self, epoch, skip=0):
        """Yield the stream's batches for epoch `epoch`, from its batch `skip` on.

        The stream starts at the first call: at a Grain source's position
        restored for `(epoch, skip)`, else at the data's start with the
        first `skip` batches dropped.
        """
        if self._stream is None:
            epochs = getattr(self._batches, "resumable", None)
            if epochs is not None:  # where the stream starts, to save again if stopped there
                self._states[(epoch, skip)] = epochs.restored(epoch, skip)
            self._stream = self._passes(epoch, skip)
        return self._marked(self._epoch(epoch, skip))

    def _epoch(self, epoch, skip):
        epochs = getattr(self._batches, "resumable", None)
        for old in [key for key in self._states if key[0] < epoch - 1]:
            del self._states[old]  # no checkpoint will name them
        for steps in range(skip + 1, self.steps + 1):
            batch = next(self._stream, None)
            if batch is None:
                self.exhausted = True
                warnings.warn(
                    f"The input ran out of data in epoch {epoch + 1}; training "
                    "stops here. Make sure the data can give at least "
                    "`steps_per_epoch * epochs` batches: pass a re-iterable "
                    "(a tf.data.Dataset, a list) or `.repeat()` the dataset.",
                    stacklevel=2,
                )
                return
            if epochs is not None and epochs.recording:
                # The state after this batch, under both names of its position.
                self._states[(epoch, steps)] = epochs.last
                if steps == self.steps:
                    self._states[(epoch + 1, 0)] = epochs.last
            yield batch

    def _passes(self, epoch, skip):
        if getattr(self._batches, "resumable", None) is not None:
            yield from self._batches.epoch(epoch, skip)  # from a restored position
        else:
            yield from itertools.islice(self._batches.epoch(0), skip, None)
        for data_pass in itertools.count(1):
            if not self._batches.reiterable:
                return
            yield from self._batches.epoch(data_pass)


def _warn_if_epochs_span_passes(batches, steps, epochs):
    """Warn when an epoch of `steps` steps would span the end of a pass over `batches`.

    That happens when `steps` does not divide the data's known batches per
    pass and the `epochs` to run read past the first pass (`epochs` None:
    assume they do). Such an epoch runs on into the next pass, where
    `model.fit` ends an epoch at the end of the data ("Your input ran out of
    data") and starts the next one on a new pass, so the steps differ from
    Keras's from there on.
    """
    per_pass = batches.steps  # None where the data's length is unknown
    if not per_pass or per_pass % steps == 0:
        return
    if epochs is not None and epochs * steps <= per_pass:
        return
    warnings.warn(
        f"The data holds {per_pass} batches a pass, which steps_per_epoch={steps} "
        f"does not divide: each epoch here takes {steps} steps, running on into the "
        "next pass, where Keras's model.fit ends an epoch when the pass ends (\"Your "
        "input ran out of data\") and so trains other steps. For one pass per epoch, "
        f"drop steps_per_epoch (or pass a divisor of {per_pass}); for a stream of "
        "batches, .repeat() the dataset.",
        stacklevel=4,
    )


class FirstSteps(FixedSteps):
    """The first `steps` batches of the data, read afresh at every pass.

    This is how `model.evaluate(steps=...)` and `model.fit(validation_steps=...)`
    read their data: Keras restarts it for each evaluation, so an endless
    dataset can be scored. Data with fewer batches is read whole, with a
    warning, as Keras does.
    """

    def __init__(self, batches, steps):
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
            raise ValueError(
                f"`steps` and `validation_steps` must be an int of at least 1. Received: {steps!r}."
            )
        self._batches = batches
        self._hooks_outside()
        self.steps = int(steps) if batches.steps is None else min(int(steps), batches.steps)
        self._asked = int(steps)

    def epoch(self, epoch, skip=0):
        """Yield the data's first `steps` batches, from batch `skip` on."""
        return self._marked(self._first(epoch, skip))

    def _first(self, epoch, skip):
        count = skip
        for batch in itertools.islice(self._batches.epoch(epoch, skip), self._asked - skip):
            count += 1
            yield batch
        if count < self._asked:
            warnings.warn(
                f"The data ran out after {count} batches, fewer than the "
                f"{self._asked} steps asked for; all {count} were used.", stacklevel=2)


# How long closing a `prefetch` waits for its producer to finish an item.
STOP_WAIT_S = 30


def steps_per_execution(model, value=None):
    """K, the steps per compiled call: `value`, else the model's from `compile`, else 1.

    Raises:
        ValueError: `value`, or the model's from `compile` when `value` is
            None, is not an int of at least 1.
    """
    received = f"steps_per_execution={value!r}"
    if value is None:
        value = getattr(model, "steps_per_execution", None)
        # Keras's compile stores any value; its fit then fails on 0 deep in its loop.
        received = f"model.compile(steps_per_execution={value!r})"
        value = 1 if value is None else value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(
            "`steps_per_execution` is the number of steps each compiled call "
            f"runs, an int of at least 1. Received: {received}."
        )
    return int(value)


def group_steps(batches, steps_per_execution, key=None):
    """Group host batches for execution: lists of K batches of the same shapes.

    A run of fewer than K batches of the same shapes (an epoch's end, a
    partial batch, a dataset whose batches change shape) comes out as
    single-batch lists, for the one-step program: every batch is used, in
    order, and batches of one shape share two programs. `key`, if given,
    replaces the shapes as what must be equal within a group (across
    processes: every process's row counts).
    """
    key = key or _shapes
    pending = []
    for batch in batches:
        if pending and key(batch) != key(pending[0]):
            yield from ([single] for single in pending)
            pending = []
        pending.append(batch)
        if len(pending) == steps_per_execution:
            yield pending
            pending = []
    yield from ([single] for single in pending)


def _shapes(batch):
    batch_rows(batch)  # the arrays agree on their rows, or a clear error
    return [np.shape(array) for array in jax.tree.leaves(batch)]


def prefetch(items, depth):
    """Yield `items` in order, produced up to `depth` ahead by a thread.

    The producer (slicing, shuffling, reading tf.data, padding and the copy
    to the devices) then runs while the devices compute the previous step.
    It dispatches no computation, so it does not count against the bound on
    steps in flight. An exception in the producer is raised here, at the
    item where it happened. Closing this generator stops the producer and
    waits for it to finish the item in hand (at most `STOP_WAIT_S`), so that
    no thread of it is left inside native code (a copy to the devices) when
    the process exits: Python ending such a thread at exit can abort the
    process. `depth=0` produces inline, without a thread.
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

    producer = threading.Thread(target=produce, name="keras_dp-prefetch", daemon=True)
    producer.start()
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
        producer.join(STOP_WAIT_S)

