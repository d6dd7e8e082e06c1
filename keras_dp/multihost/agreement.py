"""Every process's `fit`, `evaluate` or `predict` checked against the others' first.

Across processes each process runs its own copy of the program, so a
setting that differs between them (a `batch_size`, the `epochs`, a layer's
width, `validation_data` on one only) or an error that one process alone
raises while preparing (no rows, bad labels) would leave the others waiting
in a collective for ever, abort in native code, or train silently on
batches no process asked for. So `fit`, `evaluate` and `predict` prepare
under `preparing` (their checks of the data and the building of the model), and then
every process publishes either its settings or its error, in one round
through JAX's coordination service (`keras_dp.multihost.channel`): each process then
raises the same clear error, or all train. A process whose peers do not
come to the round (a call made on process 0 only, `if is_primary():
trainer.evaluate(...)`) waits `timeout()` seconds at most and raises
`NotEveryProcess`, instead of waiting for ever.
"""

import contextlib
import dataclasses
import math
import warnings
import zlib

import jax
import numpy as np

from keras_dp import _messages
from keras_dp import sharding
from keras_dp.distributed import TIMEOUT_ENV
from keras_dp.distributed import NotEveryProcess
from keras_dp.distributed import timeout
from keras_dp.multihost import channel as exchange_lib

# An error's text travels as its bytes; this much of it is enough to say what.
_MESSAGE_BYTES = 400
_FAILED, _READY = 1, 0
# Not settings but fingerprints of the training data. Arrays equal on every
# process are the whole data, read as one process reads it (each process its
# part of every global batch: `ArrayBatches.read_part`); a dataset whose first
# batch is equal on every process is warned of (each process reads its data as
# its own share). Arrays are sampled whole; other data (a tf.data.Dataset,
# Grain, an iterable) by the first batch, which fit has read already to build
# the model.
_SAME_ROWS = "the training rows"
_SAME_FIRST_BATCH = "the first training batch"
# How many rows, evenly spaced, the fingerprint reads (all, if fewer).
_FINGERPRINT_ROWS = 64


class Disagreement(ValueError):
    """The processes' settings of a call differ, or a process failed preparing it."""


def settings(trainer, batches, *, batch_size, epochs, initial_epoch, shuffle, validation,
             validation_batch_size, validation_steps, validation_freq, steps_per_epoch,
             checkpoint_dir, checkpoints_to_keep=2):
    """What must be the same on every process in `fit`, as `(name, value)` pairs.

    Values are integers shown as they are, or text compared by its CRC-32.
    Asked across processes only: in one process there is nothing to agree
    on, and the optimizer's config reads its learning rate off the device.
    """
    optimizer = trainer.model.optimizer
    with warnings.catch_warnings():  # Keras's own numpy 2 `copy=` DeprecationWarning
        warnings.simplefilter("ignore", DeprecationWarning)
        config = {key: value for key, value in optimizer.get_config().items() if key != "name"}
    return [
        ("batch_size", batch_size), ("epochs", epochs), ("initial_epoch", initial_epoch),
        ("steps_per_execution", trainer.steps_per_execution), ("seed", trainer.seed),
        ("shuffle", repr(shuffle)), ("steps_per_epoch", steps_per_epoch),
        ("validation_data given", validation is not None),
        ("validation_batch_size", validation_batch_size),
        ("validation_steps", validation_steps), ("validation_freq", repr(validation_freq)),
        ("checkpoint_dir", str(checkpoint_dir)),  # absolute already (`options.check_dir`)
        ("checkpoints_to_keep", checkpoints_to_keep),
        ("state_sharding", trainer.state_sharding),
        ("kind of training data", type(batches).__name__),
        *_model(trainer.model.variables),
        ("the optimizer", f"{type(optimizer).__name__} {sorted(config.items())!r}"),
        ("the optimizer's variables (shapes, dtypes)", _shapes(optimizer.variables)),
        _fingerprint(batches, trainer.hosts.order),
    ]


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """A fingerprint of the training data (its CRC-32), and what to do where it is equal on every process."""

    code: int
    on_every_process: object  # called on every process, when the codes are all equal


def _fingerprint(batches, order):
    """`(name, Fingerprint)` of the training data's rows (see `_SAME_ROWS`).

    Arrays: their row count and up to 64 evenly spaced rows; until the
    round says they are the same on every process, they are this process's
    share (`global_order` None); if they are, each process reads its part
    (`order`: the processes in the mesh's order of their blocks). Other
    data: its first batch's row count and up to 64 of its rows, warned of
    where equal. Reading a sample keeps it cheap for data of any size; rows
    equal on every process are then very likely the whole data passed to
    each (for other data: read in the same order, so an unseeded shuffle
    escapes it).
    """
    arrays = getattr(batches, "arrays", None)
    if arrays is not None:
        batches.global_order = None

        def read_part():
            batches.read_part(order.index(jax.process_index()), len(order))

        return _SAME_ROWS, Fingerprint(_rows_fingerprint(arrays, batches.num_samples), read_part)
    first = batches.peek()
    return _SAME_FIRST_BATCH, Fingerprint(
        _rows_fingerprint(first, sharding.batch_rows(first)),
        lambda: jax.process_index() == 0 and _messages.warn(_same_first_batch(order)))


def _rows_fingerprint(tree, rows):
    picked = np.unique(np.linspace(0, rows - 1, min(rows, _FINGERPRINT_ROWS)).astype(int))
    code = zlib.crc32(str(rows).encode())
    for leaf in jax.tree.leaves(tree):
        code = zlib.crc32(np.ascontiguousarray(np.asarray(leaf)[picked]).tobytes(), code)
    return code


def inference_settings(trainer, batches, *, batch_size, steps):
    """What must be the same on every process in `evaluate` and `predict`."""
    return [
        ("batch_size", batch_size), ("steps", steps),
        ("steps_per_execution", trainer.steps_per_execution),
        ("state_sharding", trainer.state_sharding),
        ("kind of data", type(batches).__name__),
        *_model(trainer.model.variables),
    ]


def _model(variables):
    # Not their paths: Keras numbers layer names per process, so a model
    # made after another on one process only is named differently.
    return [("the model's parameter count", sum(math.prod(v.shape) for v in variables)),
            ("the model's variables (shapes, dtypes)", _shapes(variables))]


def _shapes(variables):
    return repr([(tuple(v.shape), str(v.dtype)) for v in variables])


@contextlib.contextmanager
def preparing(hosts, call="fit"):
    """Run a call's preparation, then agree with every process (see the module doc).

    Yields a list to which the preparation appends its `settings`; `call`
    names the method in the messages. One process only: nothing to agree on.

    Raises:
        Disagreement: a setting differs, or another process failed; the
            process that failed raises its own error.
        NotEveryProcess: a process did not come to the round within
            `timeout()` seconds.
    """
    found = []
    try:
        yield found
    except Exception as error:
        text = f"{type(error).__name__}: {error}".encode()[:_MESSAGE_BYTES]
        with contextlib.suppress(NotEveryProcess):  # then this process's error alone
            _gather(hosts, [_FAILED, *text], _absent(call))  # the others learn why, stop too
        raise
    _check(_gather(hosts, [_READY, *(_code(value) for _, value in found)], _absent(call)),
           found, call)


def stop_mid_epoch(hosts, epoch, index):
    """Check that every process stops after batch `index` of `epoch` (0-based), as this one does.

    One round, only when `stop_training` ends an epoch before its last
    batch: a process that did not stop there waits for this one in the next
    step, and never comes to the round.

    Raises:
        NotEveryProcess: a process did not stop there within `timeout()` s.
    """
    _same_stop(hosts, index, "stop_training", f" of epoch {epoch + 1}",
               ", or at an epoch's end, where one process's stop stops all")


def stop_mid_pass(hosts, flag, index):
    """Check that every process stops evaluate or predict after batch `index`, as this one does.

    `flag` is the model attribute a callback set (`stop_evaluating`,
    `stop_predicting`). One round, only when the stop comes before the last
    batch, as `stop_mid_epoch`'s.

    Raises:
        NotEveryProcess: a process did not stop there within `timeout()` s.
    """
    _same_stop(hosts, index, flag)


def _same_stop(hosts, index, flag, where="", otherwise=""):
    """One round in which every process says it stops after batch `index`, as `model.<flag>` asks."""
    _gather(hosts, [index], lambda seconds, process: (
        f"model.{flag} was set after batch {index}{where} on process "
        f"{jax.process_index()}, and process {process} did not stop there within "
        f"{seconds:g} s: it waits for this process in the next step. Across processes a "
        "callback must stop every process at the same batch (decide from the logs, "
        f"which are the same on every process){otherwise}. {_NO_LONGER}"))


def same_read(hosts, position):
    """Check that every process reads the model after the same step as this one, before it gathers.

    With a state split across processes, the first read of the model
    after a step (a callback's `self.model`) gathers the state from every
    process: a read on process 0 alone (`if is_primary(): self.model...`)
    would meet the others' next step in the collectives and abort them in
    native code. One round first, only for such a read.

    Raises:
        NotEveryProcess: a process did not read the model within `timeout()` s.
        Disagreement: the processes read it after different steps.
    """
    epoch, steps = position
    read_at = _gather(hosts, [epoch, steps], lambda seconds, process: (
        f"A callback read the model (self.model) after {steps} steps of epoch {epoch + 1} "
        f"on process {jax.process_index()}, and process {process} did not read it there "
        f"within {seconds:g} s. The training state is split across processes "
        "(state_sharding), so reading the model gathers it from every process: read "
        "it on every process at the same step, and write files on process 0 only "
        "(put `if keras_dp.distributed.is_primary():` around the write, not the read). "
        f"{_NO_LONGER}"))
    if len({tuple(values) for values in read_at}) > 1:
        raise Disagreement(
            "The processes read the model (self.model, in a callback) after different "
            "steps: " + ", ".join(f"{_start_words(*values)} on process {process}"
                                   for process, values in enumerate(read_at))
            + ". The training state is split across processes, so every process must "
            "read the model at the same step.")


def same_start(hosts, epoch, steps=0):
    """Check that every process resumes fit after `steps` steps of epoch `epoch` (0-based), as this one.

    One round per fit that restores (a `checkpoint_dir`, a `BackupAndRestore`):
    a checkpoint or backup that one process reads and another does not (a
    directory one of them does not see, a read that failed on one) would
    start them at different points, and the next collective would mix
    their batches or wait forever.

    Raises:
        Disagreement: the processes start at different points.
    """
    starts = [tuple(values) for values in _gather(hosts, [epoch, steps], _absent("fit"))]
    if len(set(starts)) > 1:
        raise Disagreement(
            "The processes resume fit at different points: " + ", ".join(
                f"{_start_words(*start)} on process {process}"
                for process, start in enumerate(starts))
            + ". Give every process the same checkpoint_dir (and BackupAndRestore "
            "backup_dir), on a filesystem they all see (process 0 writes it; every "
            "process reads it)."
        )


def _start_words(epoch, steps):
    return f"epoch {epoch + 1}" + (f" after {steps} steps" if steps else "")


def _gather(hosts, values, message):
    """One round on a new channel; past `timeout()`, `NotEveryProcess(message(seconds, process))`."""
    seconds = timeout()
    try:
        return hosts.exchange.channel(timeout=seconds).all_gather(values)
    except exchange_lib.TimedOut as error:
        raise NotEveryProcess(message(seconds, error.process)) from None


def _absent(call):
    return lambda seconds, process: (
        f"{call} on process {jax.process_index()} waited {seconds:g} s for every "
        f"process to call {call} too, and process {process} did not. Across "
        f"processes, call {call} on every process, each with its own share of the "
        "data, and print or save its result on process 0 only "
        f"(keras_dp.distributed.is_primary()). If process {process} did call it: "
        "every process must also make the same trainers in the same order "
        "(a ShardedTrainer; each fit_sharded call makes one), since their rounds "
        "are named by that order: a trainer "
        f"made on some processes only shifts the names. {_NO_LONGER}")


_NO_LONGER = ("This process can no longer work with the others: let the error end it. "
              f"({TIMEOUT_ENV} sets how long a process waits.)")


def _code(value):
    if isinstance(value, Fingerprint):
        return value.code
    if value is None:
        return -1
    if isinstance(value, (bool, int)):
        return int(value)
    return zlib.crc32(str(value).encode())


def _check(gathered, found, call):
    failed = [process for process, values in enumerate(gathered) if values[0] == _FAILED]
    if failed:
        process = failed[0]
        reason = bytes(gathered[process][1:]).decode(errors="replace")
        raise Disagreement(
            f"Process {process} failed while preparing {call}, so this process "
            f"(process {jax.process_index()}) stops too instead of waiting "
            f"for it: {reason}"
        ) from None
    for index, (name, mine) in enumerate(found):
        values = [values[1 + index] for values in gathered]
        if isinstance(mine, Fingerprint):
            if len(set(values)) == 1:
                mine.on_every_process()
        elif len(set(values)) > 1:
            raise Disagreement(_differs(call, name, mine, values)) from None


def _same_first_batch(order):
    processes = len(order)
    return (
        f"The first training batch is the same on all {processes} processes. Across "
        "processes, a dataset or iterable is read as it is, as each process's own share "
        "of every global batch: if every process reads the whole data, each row is "
        f"trained {processes} times per epoch. Shard it per process: "
        "keras_dp.shard_for_processes(dataset) (a tf.data.Dataset or Grain dataset), or "
        "dataset.shard(jax.process_count(), jax.process_index()) (the docs: guides/many-hosts). "
        "If the shares are meant to start alike, ignore this warning."
    )


def _differs(call, name, mine, values):
    if isinstance(mine, bool):
        what = f"{name} is " + ", ".join(
            f"{bool(v)} on process {p}" for p, v in enumerate(values))
    elif isinstance(mine, int) or mine is None:
        what = f"{name} is " + ", ".join(
            f"{'None' if v == -1 else v} on process {p}" for p, v in enumerate(values))
    else:  # text: only its CRC-32 travelled
        groups = {}
        for process, value in enumerate(values):
            groups.setdefault(value, []).append(process)
        parts = [f"{'processes' if len(ps) > 1 else 'process'} {', '.join(map(str, ps))} "
                 f"{'have' if len(ps) > 1 else 'has'} {'one value' if i == 0 else 'another'}"
                 for i, ps in enumerate(groups.values())]
        what = (f"{name} differs ({'; '.join(parts)}; this process, "
                f"{jax.process_index()}, has {mine!s:.200})")
    return (
        f"{call}'s settings differ between processes: {what}. Every process must "
        f"run the same {call} (the same arguments, model and optimizer), each with "
        "its own share of the data; otherwise they would wait for each other's "
        "steps for ever or train on batches no process asked for."
    )
