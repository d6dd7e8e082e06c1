"""Grain as a source: one pass per epoch, resumable mid-epoch from a checkpoint.

A `grain.MapDataset`, `grain.IterDataset` or `grain.DataLoader` of batches
is read as `model.fit` reads it (Keras's Grain adapter): each epoch is a
fresh pass, `iter(dataset)`, and each batch is `x`, `(x, y)` or
`(x, y, sample_weight)`. Reshuffling per epoch is the pipeline's own
(`MapDataset.shuffle` over a `.repeat(epochs)`, or an `IndexSampler`'s
`num_epochs`); keras_dp never rewrites it.

What Grain adds over any iterable is a position that can be saved: the
iterator's `get_state()` (a small dict, or JSON bytes for a `DataLoader`).
While a fit writes checkpoints (`record`), the state after each batch read
is kept, a bounded window of them, because the look-ahead thread reads
ahead of the step that is saved; a checkpoint after `n` steps of an epoch
stores the state after batch `n`. Across processes each process's state is
gathered into one array, `(processes, STATE_BYTES)` bytes, so that the
checkpoint (written by process 0) holds every process's position. On
resume, each process takes its row, and the epoch's iterator is
`set_state` to it: it continues from the next element without reading
the batches already trained on. Under `steps_per_epoch` the epochs draw from
one continuing stream, and `StreamPosition` names its states by the stream's
`(epoch, steps)`, an epoch's end included, so the stream restarts there.

A `grain.experimental.ElasticIterator` is Grain's own answer to a job that
comes back on another number of hosts: it shards a global `MapDataset`
itself (process p of P takes elements `p, p + P, ...` of each global batch
of rows, `global_batch_size / P` of them) and its state counts global rows
(`{"global_next_index": n}`), the same on every process. So its position
resumes on any number of processes: each takes the saved state (every row
of the saved array is the same) and continues with its own share of the
next global batch. keras_dp reads a fresh `ElasticIterator` per epoch
(`iter()` of one returns the same iterator every time). Like Grain, it
drops the last global batch if it is partial.

`grain` is imported only when such a source is passed.
"""

import contextlib
import itertools
import json
import sys

import jax
import numpy as np

from keras_dp import _compat

# Bytes kept per process for its iterator state as JSON (a DataLoader's, the largest, is under 1 KiB).
STATE_BYTES = 16384
# States kept behind the newest read: more than the look-ahead can hold.
KEPT_STATES = 4096


def is_grain(source):
    """Whether `source` is a Grain dataset or DataLoader (without importing grain first)."""
    if not type(source).__module__.startswith("grain"):
        return False
    import grain

    return isinstance(source, (grain.MapDataset, grain.IterDataset, grain.DataLoader))


class GrainEpochs:
    """A Grain dataset or DataLoader as a re-iterable of batches, one pass per epoch."""

    def __init__(self, dataset):
        self._dataset = dataset
        self._states = {}
        self._restored = None  # (epoch, steps, state) read from a checkpoint
        self.recording = False
        self.last = None  # while recording: the state after the newest batch read
        self.elastic = _compat.grain_elastic(dataset)  # a position the same on every process
        self.global_batch_size = (_compat.grain_elastic_batch_size(dataset) if self.elastic
                                  else None)
        self.endless = _endless(dataset)

    def __iter__(self):
        """A fresh pass from the first element."""
        return self._read(self._fresh(), 0)

    def _fresh(self):
        """A new iterator of the dataset, at its first element."""
        if self.elastic:
            return _compat.grain_elastic_pass(self._dataset)
        return iter(self._dataset)

    def resume(self, epoch, skip):
        """Epoch `epoch`'s batches from batch `skip` on.

        From the restored iterator state when a checkpoint saved this very
        position (`restore`); otherwise read from the start and the first
        `skip` dropped, as for any iterable.
        """
        state = self.restored(epoch, skip)
        if state is not None:
            iterator = self._fresh()
            iterator.set_state(state)
            self._restored = None
            return self._read(iterator, skip)
        return itertools.islice(iter(self), skip, None)

    def _read(self, iterator, first):
        states = self._states = {}
        if self.recording and first:  # a restored position can be saved again as it is
            states[first] = self.last = iterator.get_state()
        try:
            with _flags_explained():
                for index, batch in enumerate(iterator, first + 1):
                    if self.recording:
                        states[index] = self.last = iterator.get_state()
                        states.pop(index - KEPT_STATES, None)
                    yield batch
        finally:
            _close(iterator)

    def restored(self, epoch, skip):
        """The state restored for `(epoch, skip)` (see `restore`), or None: a fresh start."""
        if self._restored is not None and self._restored[:2] == (epoch, skip):
            return self._restored[2]
        return None

    def template(self):
        """The saved states' array for a checkpoint's layout: its shape and dtype."""
        return np.zeros((jax.process_count(), STATE_BYTES), np.uint8)

    def saved(self, position):
        """Every process's iterator state after `position.steps` steps of its epoch.

        Across processes every process must call it at the same step (it
        gathers). At an epoch's end (`steps == 0`) nothing is stored: the
        next epoch starts a fresh pass.

        Returns:
            A `(processes, STATE_BYTES)` uint8 array, one JSON text per row.
        """
        return self.pack(kept(self._states, position.steps) if position.steps else None)

    def pack(self, state):
        """Every process's `state` (None: a fresh pass) as the array `saved` describes.

        Across processes every process must call it at the same step (it gathers).
        """
        row = _encode(state)
        if jax.process_count() == 1:
            return row[None]
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(row))

    def restore(self, position, saved):
        """Continue epoch `position.epoch` after `position.steps` steps from `saved` (see `saved`).

        `saved` has a row per process of the run that wrote it. Another
        process count is read when every row is empty (an epoch's end: a
        fresh pass), or for an `ElasticIterator`, whose rows are all the
        same; `keras_dp.checkpoint.store` refuses the rest before this.
        """
        saved = np.asarray(saved)
        if self.elastic and len(saved) and (saved == saved[0]).all():
            saved = np.repeat(saved[:1], jax.process_count(), axis=0)
        if len(saved) != jax.process_count():
            if holds_positions(saved):
                raise ValueError(
                    f"keras_dp: the checkpoint holds the Grain positions of {len(saved)} "
                    f"processes, and this run has {jax.process_count()}. Please report "
                    "this: it should have been refused with the reason before.")
            self._restored = None
            return
        state = _decode(saved[jax.process_index()])
        self._restored = None if state is None else (position.epoch, position.steps, state)


def holds_positions(saved):
    """Whether a checkpoint's saved states (see `GrainEpochs.saved`) hold any position."""
    return any(_decode(row) is not None for row in np.asarray(saved))


def _close(iterator):
    """Stop a Grain iterator's prefetch threads (and worker processes) now.

    They stay until the iterator is closed or collected, and an error's
    traceback keeps it alive. A `DataLoader`'s iterator has no `close`: the
    dataset iterator it wraps does.
    """
    for each in (iterator, _compat.grain_inner_iterator(iterator)):
        close = getattr(each, "close", None)
        if close is not None:
            close()
            return


@contextlib.contextmanager
def _flags_explained():
    """Grain's worker processes read absl flags: say how to parse them, in one line."""
    try:
        yield
    except Exception as error:
        if type(error).__name__ != "UnparsedFlagAccessError":
            raise
        raise RuntimeError(
            "A grain.DataLoader with worker_count > 0 reads absl flags, which "
            "this program has not parsed (absl.app.run parses them). Call "
            "`absl.flags.FLAGS.mark_as_parsed()` before fit, or use "
            f"worker_count=0. Grain said: {error}") from None


def _endless(dataset):
    """What `dataset` is if it never ends (see `pipeline.check_ends`), else None."""
    import grain

    if isinstance(dataset, grain.DataLoader):
        if _compat.grain_loader_epochs(dataset) is None:
            return "a grain.DataLoader whose sampler has num_epochs=None"
        return None
    if _compat.grain_elastic(dataset):
        dataset = _compat.grain_elastic_dataset(dataset)
    if _repeats_forever(dataset):
        return "a Grain dataset that repeats forever (repeat() without num_epochs)"
    return None


# Grain gives an endless MapDataset the length sys.maxsize (divided by the
# batch size, once batched): lengths from this on are read as endless.
_ENDLESS_LENGTH = sys.maxsize >> 24
# IterDatasets that may end what they read from: their ancestry says nothing.
_MAY_END = ("Limit", "Mixed", "Slice", "Concatenate")


def _repeats_forever(node):
    """Whether a Grain dataset is known to be endless (a `repeat()` without num_epochs)."""
    import grain

    if isinstance(node, grain.MapDataset):
        return len(node) >= _ENDLESS_LENGTH
    name = type(node).__name__
    if name.startswith(_MAY_END):
        return False
    if name == "RepeatIterDataset" and _compat.grain_repeat_epochs(node) is None:
        return True
    return any(_repeats_forever(parent) for parent in getattr(node, "parents", ()))


def kept(states, key):
    """`states[key]`, or a `RuntimeError` saying that the state was not kept."""
    if key not in states:
        raise RuntimeError(
            f"keras_dp: the Grain iterator's state at {key} was not kept, so the "
            "checkpoint could not say where the input stands. Please report this.")
    return states[key]


class StreamPosition:
    """The position of a Grain stream under `steps_per_epoch` (`pipeline.StepsPerEpoch`).

    Epochs of a fixed length draw from one continuing stream, so every
    position, an epoch's end included, has a state: `states[(epoch, steps)]`,
    kept by the `StepsPerEpoch` as it hands out each batch. Restoring it
    makes the stream start there.
    """

    def __init__(self, epochs, states):
        self._epochs, self._states = epochs, states

    @property
    def recording(self):
        """Whether states are kept (set by `keras_dp.checkpoint.store.open_for_fit`)."""
        return self._epochs.recording

    @recording.setter
    def recording(self, value):
        self._epochs.recording = value

    def template(self):
        """See `GrainEpochs.template`."""
        return self._epochs.template()

    def saved(self, position):
        """Every process's stream state at `position` (see `GrainEpochs.saved`)."""
        return self._epochs.pack(kept(self._states, (position.epoch, position.steps)))

    def restore(self, position, saved):
        """Start the stream at `position` from `saved`."""
        self._epochs.restore(position, saved)


def _encode(state):
    if state is None:
        text = b""
    elif isinstance(state, bytes):  # a DataLoader's iterator: JSON already
        text = json.dumps({"bytes": state.decode()}).encode()
    else:
        text = json.dumps({"dict": state}).encode()
    if len(text) > STATE_BYTES:
        raise ValueError(
            f"The Grain iterator's state is {len(text)} bytes as JSON, more than "
            f"the {STATE_BYTES} a checkpoint keeps per process. Use fewer "
            "workers, or drop checkpoint_dir.")
    row = np.zeros(STATE_BYTES, np.uint8)
    row[:len(text)] = np.frombuffer(text, np.uint8)
    return row


def _decode(row):
    text = bytes(row).rstrip(b"\0")
    if not text:
        return None
    saved = json.loads(text)
    return saved["bytes"].encode() if "bytes" in saved else saved["dict"]
