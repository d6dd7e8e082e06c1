"""Device-resident array data: placed on the mesh once, each step's rows gathered there.

With array data (`pipeline.ArrayBatches`) on one process, `fit` can put the
arrays `(x, y, sample_weight)` on the devices once and feed every epoch
without copying a batch from the host: per epoch only the epoch's row order
(the permutation `ArrayBatches.order` gives, `n` int32s) and the first
position of each call (one int32, or K) go to the devices, and the compiled
step takes its rows from the resident arrays with `jnp.take`. The gathered
batch is padded exactly as `placement.to_device` pads a host batch (the
last real row repeated) and cut to its real rows by the same step, so
training is bitwise the host path's, partial last batch, K-step calls,
class and sample weights included.

The arrays are *replicated*: every device holds all of them. Gathering rows
in a shuffled order from arrays split over `"batch"` would move rows between
devices at every step (an all-gather or an all-to-all inside the step);
from a full copy each device gathers its own share of the batch with no
communication. The price is memory: the whole dataset on every device,
which is what `fits` checks. The arrays are an argument of the compiled
step, so it compiles once per dataset shape (and row count per step).

`data_on_device` (on `ShardedTrainer` and `fit_sharded`) chooses:
`"auto"` (the default; `None` means the same) is resident when the data is
arrays on one process without `steps_per_epoch` and fits, and otherwise
the host path, with a warning when only the size stood in the way; `True`
insists (a `ValueError` naming why not); `False` is the host path.
"""

import dataclasses
import itertools
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from keras_dp.diagnostics import memory as memory_lib
from keras_dp import sharding as mesh_lib
from keras_dp import sources as pipeline
from keras_dp.core import placement
from keras_dp.core import steps as steps_lib

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


def check_option(data_on_device, multiprocess=False):
    """`data_on_device` normalised: `"auto"`, `True` or `False` (`None` is `"auto"`).

    Raises:
        ValueError: any other value, or `True` on a mesh across processes.
    """
    data_on_device = pipeline.check_auto("data_on_device", data_on_device)
    if data_on_device is True and multiprocess:
        raise ValueError(
            "data_on_device=True keeps the whole dataset on every device, "
            "but this mesh spans processes and each holds only its share. "
            "Pass data_on_device='auto' or False."
        )
    return data_on_device


def data_bytes(arrays):
    """The bytes a tree of numpy arrays takes on a device, in JAX's dtypes.

    Without `jax_enable_x64`, float64 and int64 arrays are kept as float32
    and int32 (`ResidentFeed` puts them so), half their host bytes: a
    float64 frame that fits was judged twice its size.
    """
    return sum(np.size(leaf) * jax.dtypes.canonicalize_dtype(np.asarray(leaf).dtype).itemsize
               for leaf in jax.tree.leaves(arrays))


def fits(nbytes, mesh, peak=None):
    """Whether `nbytes` of data, replicated, fits on `mesh`: `(fits, why not)`.

    On devices that report `memory_stats()["bytes_limit"]`, the data must
    take at most `MEMORY_FRACTION` of every device's free memory, and, when
    `peak` (the train step's peak bytes per device, `MemoryPlan.peak`) is
    given, the data and that peak together at most `WITH_STEP_FRACTION` of
    it; on devices that do not report it (XLA:CPU), its copies together at
    most `CPU_CAP_BYTES`.
    """
    devices = list(mesh.devices.flat)
    free = memory_lib.least_free(devices)
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


def make_feed(trainer, batches, plan=None):
    """The feed of this fit: a `ResidentFeed`, else `placement.HostFeed`.

    Decides by `trainer.data_on_device` (see the module doc) and, where
    given, the fit's `MemoryPlan` of its train step (`fits`).

    Raises:
        ValueError: `data_on_device=True` with data that cannot be resident:
            a dataset or iterable, `steps_per_epoch`, a mesh spanning
            processes, or arrays that do not fit.
    """
    choice = trainer.data_on_device
    keep, why_not = decide(trainer, batches, plan)
    if keep:
        return ResidentFeed(trainer, batches)
    if choice == "auto" and why_not is not None and _ineligible(trainer, batches) is None:
        warnings.warn(  # arrays too big: the one case "auto" warns about
            f"data_on_device='auto': {why_not}; feeding batches from the "
            "host instead. Pass data_on_device=False to choose that "
            "without this warning.", stacklevel=3)
    if choice is True:
        raise refusal(why_not)
    return placement.HostFeed(trainer, batches)


def refusal(why_not):
    """The `ValueError` of `data_on_device=True` with data that cannot be resident."""
    return ValueError(
        f"data_on_device=True cannot keep this data on the devices: "
        f"{why_not}. Pass data_on_device='auto' (resident when it can "
        "be, else the host path) or False."
    )


def decide(trainer, batches, plan=None, choice=None):
    """Whether a fit on `batches` keeps them on the devices: `(keep, why not)`.

    What `make_feed` does, without placing anything or warning: `why not`
    is None when the data is kept, or when `data_on_device=False` chose
    the host. `plan`: the fit's `MemoryPlan`, if it made one. `choice`:
    a `data_on_device` setting to decide by instead of the trainer's.
    """
    if (trainer.data_on_device if choice is None else choice) is False:
        return False, None
    why_not = _ineligible(trainer, batches)
    if why_not is None:
        fit, why_not = fits(data_bytes(batches.arrays), trainer.mesh,
                            None if plan is None else plan.peak)
        if fit:
            return True, None
    return False, why_not


def _ineligible(trainer, batches):
    """Why `batches` cannot be resident on `trainer`'s mesh, or `None`."""
    if trainer.multiprocess:
        return ("the mesh spans processes, and each process holds only its "
                "share of the data")
    if isinstance(batches, pipeline.StepsPerEpoch):
        return ("`steps_per_epoch` draws epochs from a continuing stream; "
                "leave it unset for array data")
    if not isinstance(batches, pipeline.ArrayBatches):
        return ("the data is a dataset or iterable, read batch by batch; "
                "pass numpy arrays (x, y) instead")
    return None


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
    yields `(steps, Rows)` in the grouping `Placement.steps` gives host
    batches, and `program` is the trainer's resident program for a call
    (`keras_dp.core.programs.run_call` runs it).
    """

    def __init__(self, trainer, batches):
        self._trainer, self._batches = trainer, batches
        self._arrays = jax.device_put(batches.arrays, mesh_lib.replicated(trainer.mesh))

    def epoch(self, epoch, skip):
        """Yield `(steps, Rows)` for epoch `epoch`'s calls after its first `skip` steps.

        The order and every call's start go to the devices in one transfer
        here, before the first step: none happens between steps.
        """
        size, total = self._batches.batch_size, self._batches.num_samples
        positions = (np.arange(start, min(start + size, total))
                     for start in range(0, total, size))
        groups = list(pipeline.group_steps(itertools.islice(positions, skip, None),
                                           self._trainer.steps_per_execution))
        order = self._batches.order(epoch)
        order = np.arange(total) if order is None else order
        starts = [np.int32(group[0][0]) if len(group) == 1
                  else np.asarray([part[0] for part in group], np.int32) for group in groups]
        order, starts = jax.device_put((order.astype(np.int32), starts),
                                       mesh_lib.replicated(self._trainer.mesh))
        for group, start in zip(groups, starts):
            yield len(group), Rows(order, start, len(group[0]))

    def program(self, steps):
        """The jitted program of a call of `steps` steps, and its arguments before `rows`."""
        return self._trainer.programs.resident(steps), (self._arrays,)


def abstract_arguments(batches, mesh):
    """The arguments after the state of a fit's first one-step call, as abstract arrays.

    `(arrays, Rows)` with the shapes, dtypes and shardings `ResidentFeed`
    gives them (the arrays replicated, in JAX's dtypes), for
    `jitted.lower` without placing anything: `keras_dp.diagnostics.memory.plan` of the
    resident step, which the fit then finds traced and compiled.
    """
    replicated = mesh_lib.replicated(mesh)

    def like(shape, dtype):
        return jax.ShapeDtypeStruct(shape, jax.dtypes.canonicalize_dtype(dtype),
                                    sharding=replicated)

    total = batches.num_samples
    arrays = jax.tree.map(lambda array: like(np.shape(array), np.asarray(array).dtype),
                          batches.arrays)
    return arrays, Rows(like((total,), np.int32), like((), np.int32),
                        min(batches.batch_size, total))


def make_steps(model, mesh, *, unroll, state_sharding, donate):
    """Return the jitted resident programs `(train_step, train_steps)`.

    `train_step(state, arrays, rows) -> (state, logs)` and
    `train_steps(state, arrays, rows) -> (state, logs, finite)` are
    `steps.make_train_step` and `steps.make_multi_train_step` on the batch
    `gather` takes from `arrays`; `state` is donated (unless `donate` is
    False), `arrays` only read.
    """
    step = steps_lib.sharded_train_step(model, mesh, state_sharding)

    def train_step(state, arrays, rows):
        return step(state, gather(arrays, rows.order, rows.start, rows.rows, mesh))

    def train_steps(state, arrays, rows):
        def one(state, start):
            return step(state, gather(arrays, rows.order, start, rows.rows, mesh))

        return steps_lib.scan_train_steps(one, state, rows.start, unroll, mesh)

    # The step lays the state out (`state_sharding`) and replicates the logs.
    donate_argnums = steps_lib.donated(donate)
    return (jax.jit(train_step, donate_argnums=donate_argnums),
            jax.jit(train_steps, donate_argnums=donate_argnums))


def gather(arrays, order, start, rows, mesh):
    """Inside a compiled step: the `DeviceBatch` of rows `order[start:start + rows]`.

    Padded to a multiple of the device count with copies of the last row,
    as `placement.to_device` pads a host batch, and split over `"batch"`:
    each device gathers its share from its full copy of `arrays`.
    """
    padded = placement.padded_rows(rows, mesh)
    sharding = mesh_lib.batch_sharded(mesh)
    positions = start + jnp.minimum(jnp.arange(padded), rows - 1)
    ids = jax.lax.with_sharding_constraint(jnp.take(order, positions, mode="clip"), sharding)
    data = jax.tree.map(
        lambda array: jax.lax.with_sharding_constraint(
            jnp.take(array, ids, axis=0, mode="clip"), sharding),
        arrays,
    )
    return placement.DeviceBatch(data, rows)
