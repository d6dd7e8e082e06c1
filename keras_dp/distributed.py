"""Many processes: JAX's multi-controller runtime and each process's share.

With one process per host (`initialize` first, then the same program on
every host), JAX sees every host's devices, and keras_dp's mesh spans them
all. Nothing else in the training changes: the state is replicated on every
device of every host, each global batch is split along `"batch"`, and XLA's
gradient all-reduce now crosses hosts.

What does change is the input. Each process reads only its own share of the
data and passes it to keras_dp as it would on one host. For every step,
`global_batches` exchanges the processes' local row counts (one small
all-gather), pads each process's rows to one common block length `L` (a
multiple of its local device count) and assembles the global batch, of
`process_count * L` rows, with `jax.make_array_from_process_local_data`:
process p's rows form block p, in mesh order. The `DeviceBatch` records the
real rows of every block as static data, and the compiled step cuts them out
(`data.real_rows`), so every row of every process is used exactly once and
no padding reaches a result. A process whose share has run out sends a
block of padding with 0 real rows; the epoch ends when every process is out,
so processes with shares of different lengths run the same number of steps.
"""

import os

import jax
import numpy as np

from keras_dp import data as data_lib
from keras_dp import mesh as mesh_lib

COORDINATOR_ENV = "KERAS_DP_COORDINATOR"
NUM_PROCESSES_ENV = "KERAS_DP_NUM_PROCESSES"
PROCESS_ID_ENV = "KERAS_DP_PROCESS_ID"
HEARTBEAT_ENV = "KERAS_DP_HEARTBEAT_TIMEOUT"
DEFAULT_HEARTBEAT_TIMEOUT = 20


def initialize(coordinator_address=None, num_processes=None, process_id=None, *,
               heartbeat_timeout_seconds=None, initialization_timeout=300,
               local_device_ids=None):
    """Join this process to the others through `jax.distributed.initialize`.

    Each argument left `None` is read from the environment
    (`KERAS_DP_COORDINATOR`, `KERAS_DP_NUM_PROCESSES`, `KERAS_DP_PROCESS_ID`,
    `KERAS_DP_HEARTBEAT_TIMEOUT`); what is still missing, JAX detects from
    the cluster (SLURM, Open MPI, Kubernetes, Cloud TPU pods).

    Call it once per process, before anything starts JAX's backend (the
    first `jax.devices()`, array or compiled call): JAX fixes its device
    list when it starts.

    Args:
        coordinator_address: `"host:port"` of process 0, reachable by all.
        num_processes: how many processes take part.
        process_id: this process's index, `0 <= process_id < num_processes`.
        heartbeat_timeout_seconds: after this many seconds without a
            heartbeat from a peer, the runtime declares it dead and stops
            every other process with an error, instead of letting it wait in
            a collective for ever (default 20; JAX's own is 100).
        initialization_timeout: seconds to wait for every peer to connect.
        local_device_ids: the local accelerators this process uses (default:
            all it sees).

    Raises:
        RuntimeError: JAX has already started a backend.
        ValueError: a malformed environment variable.
    """
    # There is no public way to ask whether JAX has started; cli.py asks the
    # same question for --cpu-devices.
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise RuntimeError(
            "JAX has already started its backend, so this process can no "
            "longer join a multi-process run. Call "
            "keras_dp.distributed.initialize() first thing, before any "
            "jax.devices(), array or model creation (importing keras and "
            "keras_dp is fine)."
        )
    coordinator_address = coordinator_address or os.environ.get(COORDINATOR_ENV)
    num_processes = _int_arg(num_processes, NUM_PROCESSES_ENV)
    process_id = _int_arg(process_id, PROCESS_ID_ENV)
    heartbeat = _int_arg(heartbeat_timeout_seconds, HEARTBEAT_ENV)
    jax.distributed.initialize(
        coordinator_address, num_processes, process_id,
        local_device_ids=local_device_ids,
        initialization_timeout=initialization_timeout,
        heartbeat_timeout_seconds=heartbeat or DEFAULT_HEARTBEAT_TIMEOUT,
    )


def requested_by_environment():
    """Whether the `KERAS_DP_*` variables ask this process to join others."""
    return COORDINATOR_ENV in os.environ


def is_primary():
    """Whether this is process 0, the one that prints and writes files."""
    return jax.process_index() == 0


def barrier(name):
    """Wait until every process reaches the barrier of the same `name`."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def process_share(*arrays):
    """This process's contiguous share of arrays that every process holds whole.

    Process p of P gets rows `p * n // P` to `(p + 1) * n // P`, so the
    shares cover every row once and differ in length by at most one.

    Returns:
        The slice of each array (a single array for a single argument).
    """
    index, count = jax.process_index(), jax.process_count()
    shares = tuple(
        array[index * len(array) // count:(index + 1) * len(array) // count]
        for array in arrays
    )
    return shares[0] if len(shares) == 1 else shares


def local_batch_size(batch_size, mesh):
    """The rows per step each process slices from its share: global / processes.

    Raises:
        ValueError: a global batch that does not divide by the process count.
    """
    processes = len(block_order(mesh))
    if batch_size % processes:
        raise ValueError(
            "With several processes, `batch_size` is the global batch and "
            "each process slices batch_size / process_count rows from its "
            f"own data, so it must divide. Received: batch_size={batch_size} "
            f"with {processes} processes. Use a multiple of {processes}."
        )
    return batch_size // processes


def block_order(mesh):
    """The processes in the order of their blocks of rows along `"batch"`.

    Raises:
        ValueError: a process's devices are not one contiguous run of the
            mesh, the runs differ in length, or a process has no device.
    """
    owners = [device.process_index for device in mesh.devices.flat]
    order = [owner for i, owner in enumerate(owners) if i == 0 or owners[i - 1] != owner]
    per_process = len(owners) // len(order)
    if (len(order) != len(set(order)) or len(order) != jax.process_count()
            or len(owners) % len(order)
            or any(owners.count(owner) != per_process for owner in order)):
        raise ValueError(
            "Across processes, keras_dp needs a mesh in which every process "
            "owns one contiguous run of devices, all runs of one length. "
            f"Received a mesh whose devices belong to processes {owners}. "
            "Build it with keras_dp.make_mesh() (all devices, in JAX's order)."
        )
    return order


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
        mesh: a mesh spanning the processes (`block_order`).
        counts: every process's real row count, from `exchange_rows`.
        template: a host batch of this process, to build padding from when
            `batch` is `None`.

    Returns:
        A `DeviceBatch` of `process_count * L` rows whose `blocks` are the
        real rows of each block, in mesh order (`None` when the real rows
        are a prefix, as on one process).
    """
    order = block_order(mesh)
    blocks = tuple(int(counts[process]) for process in order)
    per_process = mesh_lib.num_devices(mesh) // len(order)
    size = -(-max(blocks) // per_process) * per_process
    # Out of data: a block of copies of one template row, never read by a step.
    source = batch if batch is not None else jax.tree.map(lambda array: array[:1], template)
    local = data_lib.pad_rows(source, size)
    sharding = mesh_lib.batch_sharded(mesh)
    global_data = jax.tree.map(
        lambda array: jax.make_array_from_process_local_data(
            sharding, array, (size * len(order),) + array.shape[1:]
        ),
        local,
    )
    if _is_prefix(blocks, size):
        return data_lib.DeviceBatch(global_data, sum(blocks))
    return data_lib.DeviceBatch(global_data, sum(blocks), blocks)


def global_batches(host_batches, mesh, template):
    """Yield the global `DeviceBatch` of every step, until all processes are out.

    Each step exchanges the local row counts first, so a process whose share
    has ended keeps taking part (with 0 real rows) while others still have
    data, and all processes stop after the same step.
    """
    iterator = iter(host_batches)
    while True:
        batch = next(iterator, None)
        counts = exchange_rows(0 if batch is None else data_lib.batch_rows(batch))
        if not counts.any():
            return
        yield to_global(batch, mesh, counts, template)


def local_rows(array, batch, mesh):
    """This process's real rows of a batch-sharded output, as numpy.

    For `predict`: row i of the result is the output for row i of the host
    batch this process passed in.
    """
    shards = sorted(array.addressable_shards, key=lambda shard: shard.index[0].start or 0)
    block = np.concatenate([np.asarray(shard.data) for shard in shards])
    order = block_order(mesh)
    position = order.index(jax.process_index())
    real = batch.blocks[position] if batch.blocks is not None else _prefix_share(
        batch.rows, block.shape[0], position
    )
    return block[:real]


def _prefix_share(rows, size, position):
    return int(np.clip(rows - position * size, 0, size))


def _is_prefix(blocks, size):
    """Whether the real rows are exactly the first `sum(blocks)` rows."""
    total = sum(blocks)
    return all(real == _prefix_share(total, size, i) for i, real in enumerate(blocks))


def _int_arg(value, env):
    if value is not None:
        return int(value)
    text = os.environ.get(env)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"The environment variable {env} must be an integer. Received: "
            f"{env}={text!r}."
        ) from None
