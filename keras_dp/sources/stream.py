"""A source cut into passes of a fixed number of steps: `steps_per_epoch`, `steps`."""

import itertools
import numbers

from keras_dp import _messages
from keras_dp import options
from keras_dp.sources import grain as grain_source
from keras_dp.sources.source import Source


class FixedSteps(Source):
    """The base of `StepsPerEpoch` and `FirstSteps`: what they pass through to their data."""

    def peek(self):
        """The first batch of the underlying data."""
        return self._batches.peek()

    @property
    def labels_checked(self):
        """Whether `check_labels` has run (on the underlying data)."""
        return self._batches.labels_checked

    @property
    def global_order(self):
        """The underlying data's (see `Source.global_order`)."""
        return self._batches.global_order

    @property
    def global_batch_size(self):
        """The underlying data's (see `Source.global_batch_size`)."""
        return self._batches.global_batch_size

    def check_labels(self, check, what):
        """Check the underlying data's labels (see its `check_labels`)."""
        self._batches.check_labels(check, what)

    def _hooks_outside(self):
        """Call a PyDataset's hooks here, around each epoch, not around each pass (`_marked`)."""
        self._batches.hooks_outside()

    def _marked(self, batches):
        """`batches`, between a PyDataset's `on_epoch_begin` and `on_epoch_end`.

        `model.fit` calls both around each epoch (and each evaluation) of a
        fixed number of steps it reads, not around each pass: an endless
        dataset has none. So per-epoch work in them runs, and a dataset
        that reshuffles in `on_epoch_end` does so after each epoch, as under
        `model.fit`. `on_epoch_end` runs once the epoch's last batch is read.
        """
        hooks = self._batches.epoch_hooks
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

    stream = True

    def __init__(self, batches, steps, epochs=None):
        self.steps = options.check_count("steps_per_epoch", steps, 1)
        _warn_if_epochs_span_passes(batches, self.steps, epochs)
        self.exhausted = False
        self._batches = batches
        self._hooks_outside()
        self._stream = None  # started by the first `epoch`
        self._states = {}  # a Grain source's state at each (epoch, steps), while recording

    @property
    def resumable(self):
        """The stream's position for checkpoints, for a Grain source; else None."""
        epochs = self._batches.resumable
        return None if epochs is None else grain_source.StreamPosition(epochs, self._states)

    def epoch(self, epoch, skip=0):
        """Yield the stream's batches for epoch `epoch`, from its batch `skip` on.

        The stream starts at the first call: at a Grain source's position
        restored for `(epoch, skip)`, else at the data's start with the
        first `skip` batches dropped.
        """
        if self._stream is None:
            epochs = self._batches.resumable
            if epochs is not None:  # where the stream starts, to save again if stopped there
                self._states[(epoch, skip)] = epochs.restored(epoch, skip)
            self._stream = self._passes(epoch, skip)
        return self._marked(self._epoch(epoch, skip))

    def _epoch(self, epoch, skip):
        epochs = self._batches.resumable
        for old in [key for key in self._states if key[0] < epoch - 1]:
            del self._states[old]  # no checkpoint will name them
        for steps in range(skip + 1, self.steps + 1):
            batch = next(self._stream, None)
            if batch is None:
                self.exhausted = True
                _messages.warn(
                    f"The input ran out of data in epoch {epoch + 1}; training "
                    "stops here. Make sure the data can give at least "
                    "`steps_per_epoch * epochs` batches: pass a re-iterable "
                    "(a tf.data.Dataset, a list) or `.repeat()` the dataset.")
                return
            if epochs is not None and epochs.recording:
                # The state after this batch, under both names of its position.
                self._states[(epoch, steps)] = epochs.last
                if steps == self.steps:
                    self._states[(epoch + 1, 0)] = epochs.last
            yield batch

    def _passes(self, epoch, skip):
        if self._batches.resumable is not None:
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
    _messages.warn(
        f"The data holds {per_pass} batches a pass, which steps_per_epoch={steps} "
        f"does not divide: each epoch here takes {steps} steps, running on into the "
        "next pass, where Keras's model.fit ends an epoch when the pass ends (\"Your "
        "input ran out of data\") and so trains other steps. For one pass per epoch, "
        f"drop steps_per_epoch (or pass a divisor of {per_pass}); for a stream of "
        "batches, .repeat() the dataset.")


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
            _messages.warn(
                f"The data ran out after {count} batches, fewer than the "
                f"{self._asked} steps asked for; all {count} were used.")


