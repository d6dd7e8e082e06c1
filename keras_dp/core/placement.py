"""Host batch to device batch and back, for one process or many.

Any global batch goes on the devices, whatever its size: the host pads its
rows (repeating the last row) to a multiple of the device count, the only
split `jax.device_put` accepts, and records the real row count as a static
part of the `DeviceBatch`. Inside a compiled step, `real_rows` cuts the
padding off again, so the model, its loss, BatchNorm's batch statistics and
the metrics all see exactly the real rows, split unevenly over the devices:
XLA's SPMD partitioner masks the missing rows out of every reduction. No row
is dropped, none is invented, and no model needs a mask.

Across processes, each process holds only its own share of every global
batch; `keras_dp.multihost.batches.MultiProcessPlacement` assembles the global
batches from the shares, one block per process, and `DeviceBatch.blocks`
records each block's real rows, which the step cuts out the same way.

`make_placement` picks the right one for a mesh. How a batch is placed is
decided here; what else differs across processes (agreeing on settings,
stops and reads) is `keras_dp.multihost.agreement`'s.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from keras_dp import sharding as mesh_lib
from keras_dp import sources as pipeline


@dataclasses.dataclass(frozen=True)
class DeviceBatch:
    """A global batch on the mesh, its rows padded to split evenly.

    Attributes:
        data: the batch's tree of `jax.Array`s; each has `rows` real rows
            followed by copies of the last one, up to the next multiple of
            the device count, sharded along `"batch"`.
        rows: the number of real rows. It is static under `jax.jit`, so a
            step compiles once per distinct row count and reuses that
            program in every later epoch.
        blocks: `None` when the real rows are the first `rows` rows (always
            so on one process). Across processes, the batch is one block of
            equal length per process, each its real rows then padding;
            `blocks` is then the tuple of each block's real row count, in
            mesh order, also static.
    """

    data: object
    rows: int
    blocks: tuple | None = None


jax.tree_util.register_dataclass(
    DeviceBatch, data_fields=["data"], meta_fields=["rows", "blocks"]
)


def make_placement(mesh, prefetch=0):
    """The placement for `mesh`: `MultiProcessPlacement` if it spans processes."""
    if mesh_lib.spans_processes(mesh):
        from keras_dp.multihost import batches as global_batches  # it builds on this module

        return global_batches.MultiProcessPlacement(mesh, prefetch)
    return Placement(mesh, prefetch)


class Placement:
    """Puts host batches on the devices of a mesh held by one process.

    Args:
        mesh: the `"batch"` mesh.
        prefetch: how many placed batches (or stacks) a background thread
            prepares ahead of the step that needs them (0: in line).
    """

    multiprocess = False

    def __init__(self, mesh, prefetch=0):
        self.mesh = mesh
        self.prefetch = prefetch

    def local_batch_size(self, batch_size):
        """The rows this process slices per step for a global `batch_size`."""
        return batch_size

    def shard(self, batch):
        """One host batch, split by rows over the mesh: a `DeviceBatch`."""
        return to_device(batch, self.mesh)

    def steps(self, host_batches, steps_per_execution, template, rows=None):
        """Yield `(steps, DeviceBatch)` for one pass (fit, evaluate or predict), looked ahead.

        Runs of `steps_per_execution` batches of one row count come as one
        stacked `DeviceBatch` (`to_device_stacked`); any other batch alone.
        `template` is one host batch of this data, and `rows` the row count
        of each host batch when known up front (see `planned_rows`); both
        serve the processes' plan across processes only.
        """
        groups = pipeline.group_steps(host_batches, steps_per_execution)
        return pipeline.prefetch(map(self._place_group, groups), self.prefetch)

    def local_rows(self, output, batch):
        """This process's real rows of a batch-sharded output, as numpy."""
        return np.asarray(output)[: batch.rows]

    def stacked_local_rows(self, output, batch):
        """The real rows of a `[K, padded_rows, ...]` output, step after step.

        For the outputs of a stacked `DeviceBatch`.
        """
        rows = np.asarray(output)[:, : batch.rows]
        return rows.reshape((-1,) + rows.shape[2:])

    def _place_group(self, group):
        if len(group) == 1:
            return 1, self.shard(group[0])
        return len(group), to_device_stacked(group, self.mesh)


def to_device(batch, mesh):
    """Place a host batch (any tree of arrays) on `mesh`, split by rows.

    Returns:
        A `DeviceBatch`. Padding repeats the last real row, so that the
        padded rows are values the model already handles; they never reach
        a result (see `real_rows`).

    Raises:
        ValueError: a batch without rows.
    """
    rows = pipeline.batch_rows(batch)
    if rows == 0:
        raise ValueError(
            "A batch with no rows cannot be placed: a step needs at least one "
            "sample. Check the slice that made it (for example x[start:stop] "
            "past the end of the data)."
        )
    batch = _pad(batch, rows, mesh)
    return DeviceBatch(jax.device_put(batch, mesh_lib.batch_sharded(mesh)), rows)


def to_device_stacked(batches, mesh):
    """Place K host batches of equal row count on `mesh` as one stack.

    Returns:
        A `DeviceBatch` whose arrays have shape `[K, padded_rows, ...]`,
        sharded `PartitionSpec(None, "batch")`: every device holds its rows
        of all K batches, for a multi-step program to scan over.
    """
    rows = pipeline.batch_rows(batches[0])
    if any(pipeline.batch_rows(batch) != rows for batch in batches):
        raise ValueError(f"Stacked batches must all have {rows} rows.")
    padded = [_pad(batch, rows, mesh) for batch in batches]
    stack = jax.tree.map(lambda *arrays: np.stack(arrays), *padded)
    return DeviceBatch(jax.device_put(stack, mesh_lib.stacked_batch_sharded(mesh)), rows)


def _pad(batch, rows, mesh):
    return pad_rows(batch, padded_rows(rows, mesh))


def padded_rows(rows, mesh):
    """The length of a placed batch of `rows` real rows: the next multiple of the device count."""
    return rows + -rows % mesh_lib.num_devices(mesh)


def abstract_batch(data, rows, mesh, steps=1, drop=1):
    """The `DeviceBatch` of a call of `steps` batches of `rows` rows, as abstract arrays.

    What `to_device` (`steps` 1) or `to_device_stacked` would make of
    batches like `data`, whose first `drop` axes (its rows, after its
    steps if stacked) are replaced by the call's: padded and split over
    the mesh, in JAX's dtypes (int64 becomes int32 unless x64 is on), for
    `jitted.lower` without placing anything.
    """
    lead = (padded_rows(rows, mesh),)
    sharding = mesh_lib.batch_sharded(mesh)
    if steps > 1:
        lead, sharding = (steps,) + lead, mesh_lib.stacked_batch_sharded(mesh)

    def like(array):
        return jax.ShapeDtypeStruct(
            lead + tuple(array.shape[drop:]), jax.dtypes.canonicalize_dtype(array.dtype),
            sharding=sharding, weak_type=getattr(array, "weak_type", False))

    return DeviceBatch(jax.tree.map(like, data), rows)


def pad_rows(batch, size):
    """`batch` grown to `size` rows with copies of its last row."""
    def pad(array):
        extra = size - array.shape[0]
        return np.concatenate([array, np.repeat(array[-1:], extra, axis=0)]) if extra else array

    return jax.tree.map(pad, batch)


class HostFeed:
    """The epochs of a fit from host batches: placed on the devices batch by batch.

    `epoch` yields `(steps, DeviceBatch)` (`Placement.steps`: K-step stacks
    and single batches, looked ahead); `program` is the trainer's train
    program for a call (`keras_dp.core.programs.run_call` runs it).
    `keras_dp.core.feed.ResidentFeed` is the other feed;
    `keras_dp.core.feed.make_feed` chooses.
    """

    def __init__(self, trainer, batches):
        self._trainer, self._batches = trainer, batches

    def epoch(self, epoch, skip):
        """Yield `(steps, DeviceBatch)` for epoch `epoch` after its first `skip` steps."""
        host_batches = self._batches.epoch(epoch, skip)
        return self._trainer.placement.steps(
            host_batches, self._trainer.steps_per_execution, self._batches.peek(),
            planned_rows(self._batches, skip))

    def program(self, steps):
        """The jitted program of a call of `steps` steps, and its arguments before the batch."""
        return self._trainer.programs.train(steps), ()


def planned_rows(batches, skip=0):
    """Each coming host batch's row count, when known before reading: a list, or None.

    Known for arrays (`pipeline.ArrayBatches`: full batches, then the
    remainder); `skip` drops the first steps, as a resumed epoch does.
    Datasets and fixed-length epochs give None: their batches are counted
    as they come.
    """
    if not isinstance(batches, pipeline.ArrayBatches):
        return None
    total, size = batches.num_samples, batches.batch_size
    return [min(size, total - start) for start in range(0, total, size)][skip:]


def planned_calls(batches, steps_per_execution, skip=0):
    """The distinct `(steps, rows)` of an epoch's calls, in order of first use, or None.

    Known when `planned_rows` is: the calls of `steps_per_execution` batches
    and the remainder's, grouped as `steps` groups them.
    """
    rows = planned_rows(batches, skip)
    if rows is None:
        return None
    calls = []
    for group in pipeline.group_steps(rows, steps_per_execution, key=lambda count: count):
        if (len(group), group[0]) not in calls:
            calls.append((len(group), group[0]))
    return calls


# -- Inside a compiled step ---------------------------------------------------


def real_rows(batch, mesh):
    """Inside a compiled step: the real rows of a `DeviceBatch`.

    The padding is cut off and the rows stay split over `"batch"` (unevenly
    when they do not divide), so every computation that follows, means and
    BatchNorm statistics included, is over exactly the real rows.
    """
    sharding = mesh_lib.batch_sharded(mesh)
    return jax.tree.map(
        lambda array: jax.lax.with_sharding_constraint(_cut(array, batch), sharding),
        batch.data,
    )


def _cut(array, batch):
    if batch.blocks is None:
        return array[: batch.rows]
    # Static slices of each process's block, joined: the shapes stay static
    # and XLA moves rows between devices where the blocks' padding differs.
    size = array.shape[0] // len(batch.blocks)
    parts = [array[i * size:i * size + real] for i, real in enumerate(batch.blocks) if real]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def restore_rows(array, batch):
    """Inside a compiled step: the inverse of `real_rows` for an output.

    Puts each real row back where its input row was, zeros in the padding,
    so an output has the input batch's padded layout (for `predict`).
    """
    padded = jax.tree.leaves(batch.data)[0].shape[0]
    tail = [(0, 0)] * (array.ndim - 1)
    if batch.blocks is None:
        return jnp.pad(array, [(0, padded - batch.rows)] + tail)
    size = padded // len(batch.blocks)
    parts, start = [], 0
    for real in batch.blocks:
        parts.append(jnp.pad(array[start:start + real], [(0, size - real)] + tail))
        start += real
    return jnp.concatenate(parts)
