"""A source read for a count of steps per epoch or evaluation: `steps_per_epoch`, `steps`."""

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


# Between two passes of `StepsPerEpoch`'s stream: where an epoch ends early.
_PASS_END = object()


class StepsPerEpoch(FixedSteps):
    """Epochs of `steps_per_epoch` steps from one continuing stream, read as `model.fit` reads them.

    Epoch e reads on from where epoch e - 1 stopped. It ends after
    `steps` steps, rounded up to whole calls of `steps_per_execution` (K),
    or where a pass over the data ends, whichever comes first: Keras's
    epoch iterator runs calls of K steps while fewer than `steps` have run,
    and ends the epoch when the data runs out ("Your input ran out of
    data"). The next epoch then starts a new pass of a re-iterable source
    (arrays reshuffled, a `tf.data.Dataset` iterated again); an epoch never
    starts on a pass that has just ended. 10 batches a pass with
    `steps=9`: 9, 1, 9, 1 steps; with `steps=11`: 10 each; with `steps=5`
    at K=2: 6, then 4. A one-shot iterator that runs out ends its epoch and
    sets `exhausted`, and the trainer stops after that epoch (Keras would
    train on a replay of the batches it read to build from).

    `epochs`, the fit's (the index after its last epoch), spares a look
    ahead past its last epoch. `steps` stays what callbacks see as
    `params["steps"]` and the progress bar's total, as under `model.fit`.
    """

    stream = True

    def __init__(self, batches, steps, steps_per_execution=1, epochs=None):
        self.epochs = epochs  # the fit's `epochs`: the index after its last epoch, if known
        self.steps = options.check_count("steps_per_epoch", steps, 1)
        self.per_epoch = -(-self.steps // steps_per_execution) * steps_per_execution
        self._batches = batches
        batches.hooks_outside()  # a PyDataset's hooks around each epoch here (`_marked`)
        self._stream = None  # started by the first `epoch`
        self._states = {}  # a Grain source's state at each (epoch, steps), while recording
        self._warned = False
        self._ahead = None  # a batch read ahead to see whether a one-shot iterator ended

    def close(self):
        """End the stream: the user's iterator it reads is let go now, not when garbage is collected.

        The stream and this object refer to each other, so without this its
        pass (a tf.data iterator and its threads, a PyDataset's workers)
        stays open after the fit, until a full collection finds the cycle.
        """
        if self._stream is not None:
            self._stream.close()
            self._stream = None

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
        steps = skip
        while steps < self.per_epoch:
            batch = self._next()
            if batch is _PASS_END and steps == skip:
                continue  # a pass that ended with the last epoch: start the next
            if batch is _PASS_END and self._batches.reiterable:
                self._ran_out(epoch, steps)
                if epochs is not None and epochs.recording:  # the next epoch starts a new pass
                    self._states[(epoch + 1, 0)] = self._states[(epoch, steps)]
                return
            if batch is _PASS_END or batch is None:  # a one-shot iterator's end
                self._used_up(f"in epoch {epoch + 1}")
                return
            steps += 1
            if epochs is not None and epochs.recording:
                # The state after this batch, under both names of its position.
                self._states[(epoch, steps)] = epochs.last
                if steps == self.per_epoch:
                    self._states[(epoch + 1, 0)] = epochs.last
            yield batch
        if not self._batches.reiterable and (self.epochs is None or epoch + 1 < self.epochs):
            # Whether a one-shot iterator ended with this epoch: if so, the
            # fit stops now rather than run an empty epoch.
            self._ahead = next(self._stream, None)
            if self._ahead is _PASS_END:
                self._used_up(f"at the end of epoch {epoch + 1}")

    def _next(self):
        """The stream's next batch, `_PASS_END` between passes, or None at its end."""
        ahead, self._ahead = self._ahead, None
        return ahead if ahead is not None else next(self._stream, None)

    def _used_up(self, where):
        """A one-shot iterator ran out (`where`: "in epoch 3"): the fit stops after this epoch."""
        self.exhausted = True
        _messages.warn(
            f"The input ran out of data {where}; training "
            "stops here. Make sure the data can give at least "
            "`steps_per_epoch * epochs` batches: pass a re-iterable "
            "(a tf.data.Dataset, a list) or `.repeat()` the dataset.")

    def _ran_out(self, epoch, steps):
        """Say once that a pass ended an epoch early, as Keras's "Your input ran out of data" does."""
        if self._warned:
            return
        self._warned = True
        _messages.warn(
            f"The data ran out after {steps} steps of epoch {epoch + 1}, before "
            f"steps_per_epoch={self.steps}: as under Keras's model.fit, the epoch ends "
            "there and the next epoch starts a new pass over the data. For epochs of "
            f"{self.steps} steps each, .repeat() the dataset (or pass a steps_per_epoch "
            "that divides the batches of a pass).")

    def _passes(self, epoch, skip):
        if self._batches.resumable is not None:
            yield from self._batches.epoch(epoch, skip)  # from a restored position
        else:
            yield from itertools.islice(self._batches.epoch(0), skip, None)
        yield _PASS_END
        for data_pass in itertools.count(1):
            if not self._batches.reiterable:
                return
            yield from self._batches.epoch(data_pass)
            yield _PASS_END


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
        batches.hooks_outside()  # a PyDataset's hooks around each epoch here (`_marked`)
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


