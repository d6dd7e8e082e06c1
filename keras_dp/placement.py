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
batch. `MultiProcessPlacement` exchanges the processes' row counts for each
step (one small all-gather), pads every process's rows to one common block
length (a multiple of its local device count) and assembles the global batch
with `jax.make_array_from_process_local_data`: process p's rows form block p,
in mesh order. `DeviceBatch.blocks` records each block's real rows, and the
step cuts them out the same way. A process whose share has run out sends a
block with 0 real rows; the epoch ends when every process is out.

`make_placement` picks the right one for a mesh, so that the trainer never
asks how many processes there are.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from keras_dp import distributed
from keras_dp import mesh as mesh_lib
from keras_dp import pipeline


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
        return MultiProcessPlacement(mesh)
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

    def steps(self, host_batches, steps_per_execution, template):
        """Yield `(steps, DeviceBatch)` for a training epoch, looked ahead.

        Runs of `steps_per_execution` batches of one row count come as one
        stacked `DeviceBatch` (`to_device_stacked`); any other batch alone.
        `template` is one host batch of this data (see `batches`).
        """
        groups = pipeline.group_steps(host_batches, steps_per_execution)
        return pipeline.prefetch(map(self._place_group, groups), self.prefetch)

    def batches(self, host_batches, template):
        """Yield the `DeviceBatch` of each host batch, looked ahead.

        `template` is one host batch of this data (padding for processes
        whose share has run out; unused on one process).
        """
        return pipeline.prefetch(map(self.shard, host_batches), self.prefetch)

    def local_rows(self, output, batch):
        """This process's real rows of a batch-sharded output, as numpy."""
        return np.asarray(output)[: batch.rows]

    def stacked_local_rows(self, output, batch):
        """The real rows of a `[K, padded_rows, ...]` output, step after step.

        For the outputs of a stacked `DeviceBatch` (one process only: across
        processes every call is a single step).
        """
        rows = np.asarray(output)[:, : batch.rows]
        return rows.reshape((-1,) + rows.shape[2:])

    def _place_group(self, group):
        if len(group) == 1:
            return 1, self.shard(group[0])
        return len(group), to_device_stacked(group, self.mesh)


class MultiProcessPlacement(Placement):
    """Assembles global batches from every process's share (see the module doc).

    Each step's row counts are exchanged with a collective, so every process
    must place the same number of batches in the same order: no look-ahead
    thread, and one step per compiled call.
    """

    multiprocess = True

    def __init__(self, mesh):
        super().__init__(mesh, prefetch=0)
        self.order = distributed.block_order(mesh)  # a mesh it can use, or raise

    def local_batch_size(self, batch_size):
        return distributed.local_batch_size(batch_size, self.mesh)

    def shard(self, batch):
        counts = exchange_rows(pipeline.batch_rows(batch))
        return to_global(batch, self.mesh, counts)

    def steps(self, host_batches, steps_per_execution, template):
        return ((1, batch) for batch in self.batches(host_batches, template))

    def batches(self, host_batches, template):
        """Yield every step's global batch until every process is out of rows."""
        iterator = iter(host_batches)
        while True:
            batch = next(iterator, None)
            counts = exchange_rows(0 if batch is None else pipeline.batch_rows(batch))
            if not counts.any():
                return
            yield to_global(batch, self.mesh, counts, template)

    def local_rows(self, output, batch):
        shards = sorted(output.addressable_shards, key=lambda shard: shard.index[0].start or 0)
        block = np.concatenate([np.asarray(shard.data) for shard in shards])
        position = self.order.index(jax.process_index())
        if batch.blocks is not None:
            return block[: batch.blocks[position]]
        return block[: _prefix_share(batch.rows, block.shape[0], position)]


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
    return pad_rows(batch, rows + -rows % mesh_lib.num_devices(mesh))


def pad_rows(batch, size):
    """`batch` grown to `size` rows with copies of its last row."""
    def pad(array):
        extra = size - array.shape[0]
        return np.concatenate([array, np.repeat(array[-1:], extra, axis=0)]) if extra else array

    return jax.tree.map(pad, batch)


def exchange_rows(rows):
    """Every process's row count for this step, indexed by process.

    One all-gather of a single integer: every process must call it, in the
    same order relative to the training steps.
    """
    from jax.experimental import multihost_utils

    counts = multihost_utils.process_allgather(np.asarray([rows], np.int32))
    return np.asarray(counts).reshape(-1)


def to_global(batch, mesh, counts, template=None):
    """Assemble the global `DeviceBatch` from this process's host batch.

    Args:
        batch: this process's host batch (a tree of arrays), or `None` when
            its share has run out.
        mesh: a mesh spanning the processes (`distributed.block_order`).
        counts: every process's real row count, from `exchange_rows`.
        template: a host batch of this process, to build padding from when
            `batch` is `None`.

    Returns:
        A `DeviceBatch` of `process_count * L` rows whose `blocks` are the
        real rows of each block, in mesh order (`None` when the real rows
        are a prefix, as on one process).
    """
    order = distributed.block_order(mesh)
    blocks = tuple(int(counts[process]) for process in order)
    per_process = mesh_lib.num_devices(mesh) // len(order)
    size = -(-max(blocks) // per_process) * per_process
    # Out of data: a block of copies of one template row, never read by a step.
    source = batch if batch is not None else jax.tree.map(lambda array: array[:1], template)
    local = pad_rows(source, size)
    sharding = mesh_lib.batch_sharded(mesh)
    global_data = jax.tree.map(
        lambda array: jax.make_array_from_process_local_data(
            sharding, array, (size * len(order),) + array.shape[1:]
        ),
        local,
    )
    if _is_prefix(blocks, size):
        return DeviceBatch(global_data, sum(blocks))
    return DeviceBatch(global_data, sum(blocks), blocks)


def _prefix_share(rows, size, position):
    return int(np.clip(rows - position * size, 0, size))


def _is_prefix(blocks, size):
    """Whether the real rows are exactly the first `sum(blocks)` rows."""
    total = sum(blocks)
    return all(real == _prefix_share(total, size, i) for i, real in enumerate(blocks))


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
