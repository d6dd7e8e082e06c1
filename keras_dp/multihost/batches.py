"""Global batches from every process's share, without a host round trip per step.

Across processes, each process holds only its own share of every global
batch. For each step, every process pads its rows to one common block
length (the step's largest local count, rounded up to a multiple of its
local device count, by repeating the last row), and
`jax.make_array_from_process_local_data` assembles the global batch:
process p's rows form block p, in mesh order. `DeviceBatch.blocks` records
each block's real rows (static), and the step cuts them out
(`sharding.real_rows`). A process whose share has run out sends a block of
padding with 0 real rows; the epoch ends when every process is out.

Every process must know every process's row count for each step, and the
counts decide how steps are grouped into K-step calls. They are agreed
ahead of use, in a fixed order, through JAX's coordination service
(`keras_dp.multihost.channel`, not a device collective), on the look-ahead thread:

- arrays: each batch's rows are known before reading (`Source.planned_rows`),
  so the whole epoch's plan is exchanged in one round;
- datasets: the counts of the next `chunk_steps(K)` batches are exchanged
  together, read ahead of the steps that use them.

So steps are never held up by an exchange, and `steps_per_execution` and the
look-ahead work as on one process.
"""

import itertools
import threading

import jax
import numpy as np

from keras_dp import distributed
from keras_dp import sharding
from keras_dp.core import feed
from keras_dp.multihost import channel as exchange_lib
from keras_dp.sharding import DeviceBatch
from keras_dp.sharding import pad_rows

# Batches read ahead per exchange of a dataset's counts, at least: fewer
# round trips to the coordinator, for a few host batches held in memory.
MIN_CHUNK = 8


def chunk_steps(steps_per_execution):
    """Steps per exchange for a dataset: a multiple of K, at least `MIN_CHUNK`."""
    return steps_per_execution * -(-MIN_CHUNK // steps_per_execution)


class GlobalBatches:
    """Assembles global batches from every process's share (see the module doc).

    Every process must call `steps` and `shard` in the same order, with
    host batches of the same structure.

    Attributes:
        exchange: its `keras_dp.multihost.channel.Exchange`; `exchange.rounds`
            counts every host round trip it made (an array epoch's plan,
            `shard`, `any_process`, the fit's agreement rounds).
    """

    def __init__(self, layout, prefetch=0):
        self.layout, self.prefetch = layout, prefetch
        self.order = distributed.block_order(layout.mesh)  # a mesh it can use, or raise
        self.exchange = exchange_lib.Exchange()

    def local_batch_size(self, batch_size):
        """The rows this process slices per step for a global `batch_size`: its share."""
        return distributed.local_batch_size(batch_size, self.layout.mesh)

    def shard(self, batch):
        """This process's host batch as its block of one global `DeviceBatch` (one round trip)."""
        counts = self.exchange.channel().all_gather([sharding.batch_rows(batch)])
        return to_global([batch], self.layout, self._blocks(counts, 0), batch)

    def any_process(self, flag):
        """Whether `flag` is true on any process (one round trip)."""
        return self.exchange.any_process(flag)

    def steps(self, host_batches, steps_per_execution, template, rows=None):
        """Yield `(steps, DeviceBatch)` until every process is out of rows.

        Groups of K steps whose blocks are equal on every process come as
        one stacked `DeviceBatch`; the plan is agreed as the module doc says.
        """
        closed = threading.Event()
        channel = self.exchange.channel(closed)
        planned = self._plan(channel, iter(host_batches), steps_per_execution, rows)
        groups = feed.group_steps(planned, steps_per_execution, key=lambda step: step[0])
        placed = (
            (len(group), to_global([batch for _, batch in group], self.layout, group[0][0],
                                   template))
            for group in groups
        )
        return _closing(feed.prefetch(placed, self.prefetch), closed)

    def _plan(self, channel, iterator, steps_per_execution, rows):
        """Yield `(blocks, host batch or None)` per global step, in order."""
        try:
            if rows is not None:  # arrays: the whole epoch in one round
                yield from self._zip(channel.all_gather(rows), iterator)
                return
            chunk = chunk_steps(steps_per_execution)
            while True:
                batches = list(itertools.islice(iterator, chunk))
                counts = channel.all_gather([sharding.batch_rows(b) for b in batches])
                if not any(itertools.chain.from_iterable(counts)):
                    return
                yield from self._zip(counts, iter(batches))
        except exchange_lib.Closed:
            return  # the consumer stopped (stop_training, an error)

    def _zip(self, counts, iterator):
        me = jax.process_index()
        for step in range(max(len(values) for values in counts)):
            mine = counts[me][step] if step < len(counts[me]) else 0
            yield self._blocks(counts, step), next(iterator) if mine else None

    def _blocks(self, counts, step):
        return tuple(counts[p][step] if step < len(counts[p]) else 0 for p in self.order)

    def local_rows(self, output, batch):
        """This process's real rows of a batch-split output, as numpy."""
        return self._own_rows(output, batch, 0)

    def stacked_local_rows(self, output, batch):
        """This process's real rows of a `[K, rows, ...]` output, step after step."""
        rows = self._own_rows(output, batch, 1)
        return rows.reshape((-1,) + rows.shape[2:])

    def _own_rows(self, output, batch, axis):
        """This process's real rows of a batch-sharded output, along `axis`."""
        shards = sorted(output.addressable_shards,
                        key=lambda shard: shard.index[axis].start or 0)
        block = np.concatenate([np.asarray(shard.data) for shard in shards], axis=axis)
        position = self.order.index(jax.process_index())
        size = block.shape[axis]
        real = (batch.blocks[position] if batch.blocks is not None
                else _prefix_share(batch.rows, size, position))
        return np.take(block, np.arange(real), axis=axis)


def _closing(generator, closed):
    """`generator`, setting `closed` when it ends or is closed (stops waiting rounds)."""
    try:
        yield from generator
    finally:
        closed.set()


def to_global(batches, layout, blocks, template):
    """Assemble one global `DeviceBatch` (or a stack of K) from this process's rows.

    Args:
        batches: this process's host batches for the step(s), each a tree
            of arrays or `None` where its share has run out. One batch
            gives one step; K give a `[K, P * L, ...]` stack, sharded
            `PartitionSpec(None, "batch")`, for a K-step program.
        layout: the `Layout` of a mesh spanning the processes (`distributed.block_order`).
        blocks: every block's real row count, in mesh order (the same for
            every step of a stack).
        template: a host batch of this process, to build padding from.

    Returns:
        A `DeviceBatch` of `P * L` rows per step whose `blocks` are the
        real rows of each block (`None` when the real rows are a prefix,
        as on one process).
    """
    per_process = layout.batch_shards // len(blocks)
    size = -(-max(blocks) // per_process) * per_process
    # Out of data: copies of one template row, never read by a step.
    local = [pad_rows(batch if batch is not None
                      else jax.tree.map(lambda array: array[:1], template), size)
             for batch in batches]
    if len(local) == 1:
        local, placed, axis = local[0], layout.batch, 0
    else:
        local = jax.tree.map(lambda *arrays: np.stack(arrays), *local)
        placed, axis = layout.stacked_batch, 1  # the rows' axis: after the stack's
    global_data = jax.tree.map(
        lambda array: jax.make_array_from_process_local_data(
            placed, array,
            array.shape[:axis] + (size * len(blocks),) + array.shape[axis + 1:]),
        local,
    )
    rows = sum(blocks)
    return DeviceBatch(global_data, rows, None if _is_prefix(blocks, size) else blocks)


def _prefix_share(rows, size, position):
    return int(np.clip(rows - position * size, 0, size))


def _is_prefix(blocks, size):
    """Whether the real rows are exactly the first `sum(blocks)` rows."""
    total = sum(blocks)
    return all(real == _prefix_share(total, size, i) for i, real in enumerate(blocks))
