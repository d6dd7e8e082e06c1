"""Feeds: how an epoch's batches reach the compiled steps, from the host or kept on the devices.

A fit's feed gives the loop `(steps, batch)` for each compiled call of an
epoch (`epoch`) and the program that runs it (`program`). There are two,
and `make_feed` chooses between them once per fit:

- `HostFeed`: host batches, grouped K at a time where they have one shape
  (`group_steps`), each group placed on the devices (`place_steps`:
  `sharding.to_device`, or a stack of K), prepared ahead of the step that
  needs it by a look-ahead thread (`prefetch`). Across processes, the
  `keras_dp.multihost` hosts assemble global batches instead.
- `ResidentFeed`: with array data on one process, the arrays `(x, y,
  sample_weight)` go on the devices once, and every epoch is fed without
  copying a batch from the host: per epoch only the epoch's row order (the
  permutation `ArrayBatches.order` gives, `n` int32s) and the first position
  of each call (one int32, or K) go to the devices, and the compiled step
  takes its rows from the resident arrays with `jnp.take`
  (`keras_dp.core.steps.gather`). The gathered batch is padded exactly as a
  host batch is (the last real row repeated) and cut to its real rows by
  the same step, so training is bitwise the host path's, partial last
  batch, K-step calls, class and sample weights included.

The resident arrays are *replicated*: every device holds all of them.
Gathering rows in a shuffled order from arrays split over the batch axis
would move rows between devices at every step (an all-gather or an
all-to-all inside the step); from a full copy each device gathers its own
share of the batch with no communication. The price is memory: the whole
dataset on every device, which is what `fits` checks. The arrays are an
argument of the compiled step, so it compiles once per dataset shape (and
row count per step).

`data_on_device` (on `ShardedTrainer` and `fit_sharded`) chooses:
`"auto"` (the default; `None` means the same) is resident when the data is
arrays on one process without `steps_per_epoch` and fits, and otherwise
the host path, with a warning when only the size stood in the way; `True`
insists (a `ValueError` naming why not); `False` is the host path.
"""

import dataclasses
import itertools
import queue
import threading

import jax
import numpy as np

from keras_dp import _messages
from keras_dp import sharding

# Where the device reports its memory: the data may take at most this
# fraction of what is free on every device (the rest is for the model, the
# optimizer, activations and XLA's scratch space).
MEMORY_FRACTION = 0.5
# And where the train step's own peak is known (the fit's `MemoryPlan`, made
# on accelerators), the data and that peak together at most this fraction.
WITH_STEP_FRACTION = 0.9
# XLA:CPU reports no memory limit; its devices are host RAM, and each
# simulated device holds its own copy, so the copies together may take at
# most this much.
CPU_CAP_BYTES = 1 << 30


def make_feed(batches, *, choice, layout, hosts, programs, steps_per_execution, plan=None):
    """The feed of this fit: a `ResidentFeed`, else a `HostFeed`.

    Decides by `choice` (`data_on_device`; see the module doc) and, where
    given, the fit's `MemoryPlan` of its train step (`fits`).

    Args:
        batches: the fit's `Source`.
        choice: `data_on_device`, normalised (`keras_dp.options.data_on_device`).
        layout: the `keras_dp.sharding.Layout`.
        hosts: the trainer's hosts (`keras_dp.multihost.hosts`).
        programs: the trainer's `keras_dp.core.programs.Programs`.
        steps_per_execution: K, the steps per compiled call.
        plan: the fit's `MemoryPlan`, where it made one.

    Raises:
        ValueError: `data_on_device=True` with data that cannot be resident:
            a dataset or iterable, `steps_per_epoch`, a mesh spanning
            processes, or arrays that do not fit.
    """
    keep, why_not = decide(batches, choice=choice, layout=layout, hosts=hosts, plan=plan)
    if keep:
        return ResidentFeed(batches, layout, programs, steps_per_execution)
    if choice == "auto" and why_not is not None and _ineligible(batches, hosts) is None:
        _messages.warn(  # arrays too big: the one case "auto" warns about
            f"data_on_device='auto': {why_not}; feeding batches from the "
            "host instead. Pass data_on_device=False to choose that "
            "without this warning.")
    if choice is True:
        raise refusal(why_not)
    return HostFeed(batches, hosts, programs, steps_per_execution)


def refusal(why_not):
    """The `ValueError` of `data_on_device=True` with data that cannot be resident."""
    return ValueError(
        f"data_on_device=True cannot keep this data on the devices: "
        f"{why_not}. Pass data_on_device='auto' (resident when it can "
        "be, else the host path) or False."
    )


def decide(batches, *, choice, layout, hosts, plan=None):
    """Whether a fit on `batches` keeps them on the devices: `(keep, why not)`.

    What `make_feed` does, without placing anything or warning: `why not`
    is None when the data is kept, or when `data_on_device=False` chose
    the host. `plan`: the fit's `MemoryPlan`, if it made one.
    """
    if choice is False:
        return False, None
    why_not = _ineligible(batches, hosts)
    if why_not is None:
        fit, why_not = fits(data_bytes(batches.arrays), layout,
                            None if plan is None else plan.peak)
        if fit:
            return True, None
    return False, why_not


def _ineligible(batches, hosts):
    """Why `batches` cannot be resident, or `None`."""
    if not hosts.whole_data:
        return ("the mesh spans processes, and each process holds only its "
                "share of the data")
    if batches.stream:
        return ("`steps_per_epoch` draws epochs from a continuing stream; "
                "leave it unset for array data")
    if batches.arrays is None:
        return ("the data is a dataset or iterable, read batch by batch; "
                "pass numpy arrays (x, y) instead")
    return None


def data_bytes(arrays):
    """The bytes a tree of numpy arrays takes on a device, in JAX's dtypes.

    Without `jax_enable_x64`, float64 and int64 arrays are kept as float32
    and int32 (`ResidentFeed` puts them so), half their host bytes: a
    float64 frame that fits was judged twice its size.
    """
    return sum(np.size(leaf) * jax.dtypes.canonicalize_dtype(np.asarray(leaf).dtype).itemsize
               for leaf in jax.tree.leaves(arrays))


def fits(nbytes, layout, peak=None):
    """Whether `nbytes` of data, replicated, fits on `layout`'s mesh: `(fits, why not)`.

    On devices that report `memory_stats()["bytes_limit"]`, the data must
    take at most `MEMORY_FRACTION` of every device's free memory, and, when
    `peak` (the train step's peak bytes per device, `MemoryPlan.peak`) is
    given, the data and that peak together at most `WITH_STEP_FRACTION` of
    it; on devices that do not report it (XLA:CPU), its copies together at
    most `CPU_CAP_BYTES`.
    """
    devices = layout.devices
    free = least_free(devices)
    if free is not None:
        limit = int(MEMORY_FRACTION * free)
        why = f"{MEMORY_FRACTION:.0%} of the {free:,} bytes free on a device"
        if nbytes > limit:
            return False, f"{nbytes:,} bytes of data exceed {limit:,}, {why}"
        limit = int(WITH_STEP_FRACTION * free)
        if peak is not None and nbytes + peak > limit:
            return False, (
                f"{nbytes:,} bytes of data and the train step's peak of {peak:,} "
                f"bytes exceed {limit:,}, {WITH_STEP_FRACTION:.0%} of the {free:,} "
                "bytes free on a device")
        return True, None
    total = nbytes * len(devices)
    return total <= CPU_CAP_BYTES, (
        f"{len(devices)} copies of {nbytes:,} bytes of data exceed the "
        f"{CPU_CAP_BYTES:,} bytes keras_dp.core.feed.CPU_CAP_BYTES allows where "
        "the device reports no memory limit"
    )


class HostFeed:
    """The epochs of a fit from host batches: placed on the devices group by group.

    `epoch` yields `(steps, DeviceBatch)` (`hosts.steps`: K-step stacks and
    single batches, looked ahead); `program` is the train program of a call
    (`keras_dp.core.programs.run_call` runs it).
    """

    def __init__(self, batches, hosts, programs, steps_per_execution):
        self._batches, self._programs = batches, programs
        self._place = hosts.steps  # one process: `place_steps`; several: global batches
        self._steps_per_execution = steps_per_execution

    def epoch(self, epoch, skip):
        """Yield `(steps, DeviceBatch)` for epoch `epoch` after its first `skip` steps."""
        host_batches = self._batches.epoch(epoch, skip)
        return self._place(host_batches, self._steps_per_execution, self._batches.peek(),
                           self._batches.planned_rows(skip))

    def program(self, steps):
        """The jitted program of a call of `steps` steps, and its arguments before the batch."""
        return self._programs.train(steps), ()

    def like(self, batch, steps, new_steps, rows, layout):
        """An abstract call argument of `new_steps` steps of `rows` rows, like `batch` (of `steps`)."""
        return sharding.abstract_batch(batch.data, rows, layout, new_steps,
                                       drop=1 if steps == 1 else 2)


def place_steps(host_batches, steps_per_execution, template=None, rows=None, *, layout,
                prefetch_depth=0):
    """Yield `(steps, DeviceBatch)` for one pass of host batches on one process, looked ahead.

    Runs of `steps_per_execution` batches of one row count come as one
    stacked `DeviceBatch` (`sharding.to_device_stacked`); any other batch
    alone (`sharding.to_device`), prepared up to `prefetch_depth` ahead.
    `template` and `rows` (a host batch, each batch's row count) serve the
    plan across processes only (`keras_dp.multihost.batches.GlobalBatches.steps`).
    """
    def place(group):
        if len(group) == 1:
            return 1, sharding.to_device(group[0], layout)
        return len(group), sharding.to_device_stacked(group, layout)

    return prefetch(map(place, group_steps(host_batches, steps_per_execution)), prefetch_depth)


def planned_calls(batches, steps_per_execution, skip=0):
    """The distinct `(steps, rows)` of an epoch's calls, in order of first use, or None.

    Known when the source knows its batches' rows before reading
    (`Source.planned_rows`: arrays): the calls of `steps_per_execution`
    batches and the remainder's, grouped as `group_steps` groups them.
    """
    rows = batches.planned_rows(skip)
    if rows is None:
        return None
    calls = []
    for group in group_steps(rows, steps_per_execution, key=lambda count: count):
        if (len(group), group[0]) not in calls:
            calls.append((len(group), group[0]))
    return calls


def group_steps(batches, steps_per_execution, key=None):
    """Group host batches for execution: K batches of the same shapes, or one.

    The batches are taken K at a time, as Keras's loops take them for one
    call (positions 0 to K - 1, K to 2K - 1, ... of what is given, so
    that the callbacks' groups, `Cadence`, are
    these): K batches of one shape come out as one group, for the K-step
    program; a run of K that changes shape (a partial batch, a dataset
    whose batches vary), or the fewer than K at the end, as single-batch
    lists, for the one-step program. Every batch is used, in order, and
    batches of one shape share two programs. `key`, if given, replaces the
    shapes as what must be equal within a group (across processes: every
    process's row counts).
    """
    key = key or _shapes
    pending = []
    for batch in batches:
        pending.append(batch)
        if len(pending) == steps_per_execution:
            yield from _split(pending, key)
            pending = []
    yield from _split(pending, key, whole=False)


def _split(run, key, whole=True):
    """`run` as one group if it is whole and of one key, else as single-batch lists."""
    if whole and (len(run) == 1 or all(key(batch) == key(run[0]) for batch in run[1:])):
        yield run
    else:
        yield from ([single] for single in run)


class Cadence:
    """Where Keras's loops call the batch hooks when a call runs K steps (`steps_per_execution`).

    Keras calls `on_*_batch_begin(b)` and `on_*_batch_end(b + K - 1)` once
    per K batches, b = 0, K, 2K, ..., a last group of fewer included: 7
    batches at K=3 end at 2, 5 and 8, and the progress bar counts 3, 6, 9
    of 7. keras_dp runs a group of K batches of one shape as one call, and
    a group it cannot stack (a partial batch in it, or the fewer than K the
    data ends with) as one-step calls: the hooks still come once per group,
    around all of its calls (`group_steps` groups the batches so). `first` is the position the groups count from (a resumed
    epoch's first step).

    The loop asks `begins(index)` before each call at `index` (True: call
    `on_*_batch_begin(index)`), `ends(index)` after it, `index` now
    counting the steps done (a batch index for `on_*_batch_end`, or None
    mid-group), and `close()` when it stops (the end of an open group, or
    None).
    """

    def __init__(self, steps_per_execution, first=0):
        self.steps_per_execution, self.first = steps_per_execution, first
        self.open = None  # the index of the open group's first batch

    def begins(self, index):
        """Whether a group begins with the call at `index` (none is open)."""
        if self.open is not None:
            return False
        self.open = index
        return True

    def ends(self, index):
        """After a call, `index` steps done: the group's end index if it is complete, else None."""
        if (index - self.first) % self.steps_per_execution:
            return None
        return self.close()

    def close(self):
        """The open group's end index (its first batch's + K - 1), closing it; None if none is open."""
        if self.open is None:
            return None
        start, self.open = self.open, None
        return start - (start - self.first) % self.steps_per_execution + self.steps_per_execution - 1


def _shapes(batch):
    sharding.batch_rows(batch)  # the arrays agree on their rows, or a clear error
    return [np.shape(array) for array in jax.tree.leaves(batch)]


# How long closing a `prefetch` waits for its producer to finish an item.
STOP_WAIT_S = 30


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


@dataclasses.dataclass(frozen=True)
class Rows:
    """Which rows of the resident arrays a call gathers: `order[start:start + rows]`.

    Attributes:
        order: the epoch's row ids in order (int32, replicated).
        start: the position in `order` of the call's first row: a scalar
            for one step, `[K]` for K steps (int32, replicated).
        rows: rows per step, static (as `DeviceBatch.rows`).
    """

    order: object
    start: object
    rows: int


jax.tree_util.register_dataclass(Rows, data_fields=["order", "start"], meta_fields=["rows"])


class ResidentFeed:
    """The epochs of a fit on resident arrays, for `keras_dp.core.loop`.

    Places `batches.arrays` on the mesh, replicated, when made; `epoch`
    yields `(steps, Rows)` in the grouping `group_steps` gives host
    batches, and `program` is the resident train program of a call
    (`keras_dp.core.programs.run_call` runs it).
    """

    def __init__(self, batches, layout, programs, steps_per_execution):
        self._batches, self._layout, self._programs = batches, layout, programs
        self._steps_per_execution = steps_per_execution
        self._arrays = jax.device_put(batches.arrays, layout.replicated)

    def epoch(self, epoch, skip):
        """Yield `(steps, Rows)` for epoch `epoch`'s calls after its first `skip` steps.

        The order and every call's start go to the devices in one transfer
        here, before the first step: none happens between steps.
        """
        size, total = self._batches.batch_size, self._batches.num_samples
        positions = (np.arange(start, min(start + size, total))
                     for start in range(0, total, size))
        groups = list(group_steps(itertools.islice(positions, skip, None),
                                  self._steps_per_execution))
        order = self._batches.order(epoch)
        order = np.arange(total) if order is None else order
        starts = [np.int32(group[0][0]) if len(group) == 1
                  else np.asarray([part[0] for part in group], np.int32) for group in groups]
        order, starts = jax.device_put((order.astype(np.int32), starts),
                                       self._layout.replicated)
        for group, start in zip(groups, starts):
            yield len(group), Rows(order, start, len(group[0]))

    def program(self, steps):
        """The jitted program of a call of `steps` steps, and its arguments before `rows`."""
        return self._programs.resident(steps), (self._arrays,)

    def like(self, batch, steps, new_steps, rows, layout):
        """An abstract `Rows` of a call of `new_steps` steps of `rows` rows, like `batch`'s."""
        start = jax.ShapeDtypeStruct(() if new_steps == 1 else (new_steps,), "int32",
                                     sharding=layout.replicated)
        return Rows(batch.order, start, rows)


def abstract_arguments(batches, layout):
    """The arguments after the state of a fit's first one-step call, as abstract arrays.

    `(arrays, Rows)` with the shapes, dtypes and shardings `ResidentFeed`
    gives them (the arrays replicated, in JAX's dtypes), for
    `jitted.lower` without placing anything: `keras_dp.diagnostics.memory.plan` of the
    resident step, which the fit then finds traced and compiled.
    """
    replicated = layout.replicated

    def like(shape, dtype):
        return jax.ShapeDtypeStruct(shape, jax.dtypes.canonicalize_dtype(dtype),
                                    sharding=replicated)

    total = batches.num_samples
    arrays = jax.tree.map(lambda array: like(np.shape(array), np.asarray(array).dtype),
                          batches.arrays)
    return arrays, Rows(like((total,), np.int32), like((), np.int32),
                        min(batches.batch_size, total))


def least_free(devices):
    """The least free memory of `devices` (`bytes_limit - bytes_in_use`), or None if unreported."""
    free = []
    for device in devices:
        try:
            stats = device.memory_stats()
        except Exception:  # noqa: BLE001 - some platforms raise instead of returning None
            stats = None
        if not stats or "bytes_limit" not in stats:
            return None
        free.append(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    return min(free, default=None)
