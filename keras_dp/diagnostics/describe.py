"""A plain-text picture of what runs where: the mesh, the state, a batch."""

import jax
import numpy as np

from keras_dp import sharding
from keras_dp.core import feed
from keras_dp.core.state import TrainState
from keras_dp.diagnostics import memory
from keras_dp.keras import build
from keras_dp.sources import inputs


def describe(layout, state=None, batch=None, hosts=None, steps_per_execution=1,
             variables=None):
    """Describe the mesh, and how `state` and a device `batch` are placed on it.

    Args:
        layout: the `keras_dp.sharding.Layout` (its mesh and batch axis).
        state: an optional `TrainState` on the mesh (any `state_sharding`),
            of arrays or of `jax.ShapeDtypeStruct`s with their shardings.
        batch: an optional `DeviceBatch`.
        hosts: for a mesh across processes, each process's host name, by
            process index (`keras_dp.distributed.host_names`).
        steps_per_execution: K; above 1, a line says how a call's K
            batches are stacked.
        variables: the Keras variables of `state` (a `TrainState`): on a
            mesh of several axes, a line per variable gives its
            `PartitionSpec` and bytes per device.

    Returns:
        A multi-line string: the devices (across processes, one line per
        process: its host and devices, for the whole mesh); for each state
        group its array count, size, bytes per device and how many arrays
        are split; for each batch array its shape, sharding and the rows
        each device of this process holds.
    """
    devices = layout.devices
    lines = _mesh_lines(layout)
    if layout.spans_processes:
        lines[0] += f", {len({device.process_index for device in devices})} processes"
        lines.extend(_process_lines(devices, hosts))
    elif len(layout.mesh.axis_names) == 1:
        lines.append("  " + ", ".join(_device_name(device) for device in devices))
    if state is not None:
        lines.extend(_state_lines(state))
        if variables is not None and len(layout.mesh.axis_names) > 1:
            lines.append("Each variable (PartitionSpec, bytes per device):")
            lines.extend("  " + line for line in memory.variable_lines(
                memory.variable_plans(variables, state)))
    if batch is not None:
        padded = jax.tree.leaves(batch.data)[0].shape[0]
        lines.append(
            f"Batch: {batch.rows} rows, split along {layout.batch_axis!r}"
            + (f" (padded to {padded}; the step cuts rows {batch.rows}-{padded - 1} off)"
               if padded != batch.rows else "")
            + ":"
        )
        for path, array in jax.tree_util.tree_leaves_with_path(batch.data):
            lines.append(
                f"  {_batch_name(path):<14} {str(array.shape):<18}"
                f"{str(array.dtype):<9}PartitionSpec{tuple(array.sharding.spec)}"
            )
            lines.append("    " + " | ".join(_shard_rows(array, batch)))
        if steps_per_execution > 1:
            lines.append(
                f"  A call of {steps_per_execution} steps takes {steps_per_execution} such "
                f"batches stacked, [{steps_per_execution}, {padded}, ...], "
                f"PartitionSpec(None, {layout.batch_axis!r}): each device holds its rows of all "
                f"{steps_per_execution}.")
    return "\n".join(lines)


def data_line(rows, nbytes, devices, keep, why_not):
    """Where a fit's training data lives: on the devices (`keep`) or on the host."""
    size = ("Training data: batches read as they come" if rows is None
            else f"Training data: {rows:,} rows, {memory.format_bytes(nbytes)}")
    if keep:
        where = "on the device" if devices == 1 else f"on each of the {devices}"
        return (f"{size}, kept on the devices for the fit: a full copy {where} "
                "(PartitionSpec()), each step gathering its rows there.")
    return (f"{size}, fed from the host, each batch copied to the devices when its "
            "step comes" + (f" ({why_not})." if why_not else " (data_on_device=False)."))


def _process_lines(devices, hosts):
    """One line per process, in mesh order: its host and its devices."""
    lines = []
    for process in dict.fromkeys(device.process_index for device in devices):
        host = f" on {hosts[process]}" if hosts else ""
        names = ", ".join(_device_name(d) for d in devices if d.process_index == process)
        lines.append(f"  process {process}{host}: {names}")
    return lines


def _mesh_lines(layout):
    """The mesh: its devices along the batch axis; with more axes, the devices of each batch shard."""
    devices, mesh = layout.devices, layout.mesh
    if len(mesh.axis_names) == 1:
        return [f"Mesh: {len(devices)} device(s) along axis {layout.batch_axis!r}, "
                f"platform {devices[0].platform}"]
    others = [axis for axis in mesh.axis_names if axis != layout.batch_axis]
    lines = [f"Mesh: {len(devices)} device(s), " + ", ".join(
        f"{axis!r} {size}" for axis, size in mesh.shape.items())
        + f", platform {devices[0].platform}; each batch is split along "
        f"{layout.batch_axis!r} and replicated along " + ", ".join(map(repr, others))]
    grid = np.moveaxis(mesh.devices, mesh.axis_names.index(layout.batch_axis), 0)
    for index, shard in enumerate(grid):
        lines.append(f"  {layout.batch_axis} {index}: "
                     + ", ".join(_device_name(device) for device in shard.flat))
    return lines


def _state_lines(state):
    """One line per state group: values, bytes per device, split or replicated."""
    lines = ["Model state (bytes per device; split arrays hold 1/N of their values):"]
    for name, values in state.groups():
        size = sum(value.size for value in values)
        per_device = sum(sharding.bytes_per_device(value) for value in values)
        split = sum(not value.sharding.is_fully_replicated for value in values)
        axes = ", ".join(map(repr, dict.fromkeys(
            axis for value in values for axis in sharding.axes_of(value.sharding.spec))))
        where = (f"{split} split over {axes}, {len(values) - split} replicated" if split
                 else "all replicated: PartitionSpec()")
        lines.append(
            f"  {name:<14}{len(values):>4} arrays {size:>12,} values "
            f"{memory.format_bytes(per_device):>10} per device  ({where})"
        )
    return lines


def _batch_name(path):
    """'x', 'y', 'sample_weight', then any nested keys: x['image']."""
    names = ("x", "y", "sample_weight")
    if path and isinstance(path[0], jax.tree_util.SequenceKey) and path[0].idx < 3:
        return names[path[0].idx] + jax.tree_util.keystr(path[1:])
    return jax.tree_util.keystr(path) or "x"


def _shard_rows(array, batch):
    """Each local device's real rows, in mesh order, and the padding it holds."""
    def span(shard):  # the padded rows it holds: (start, stop)
        return (shard.index[0] if shard.index else slice(None)).indices(array.shape[0])[:2]

    rows = []
    for shard in sorted(array.addressable_shards, key=lambda shard: span(shard)[0]):
        start, stop = span(shard)
        real = _real_span(start, stop, batch, array.shape[0])
        pad = stop - start - (0 if real is None else real[1] - real[0])
        text = ("no rows" if real is None else f"row {real[0]}" if real[1] - real[0] == 1
                else f"rows {real[0]}-{real[1] - 1}")
        rows.append(f"{_device_name(shard.device)}: {text}"
                    + (f" + {pad} padding" if pad else ""))
    return rows


def _real_span(start, stop, batch, padded):
    """The real rows among padded rows `start:stop`, numbered as the step sees them.

    `None` when all are padding. Across processes (`batch.blocks`) each
    block's real rows come first; they are numbered after the real rows
    of the blocks before it.
    """
    blocks = batch.blocks or (batch.rows,)
    size = padded // len(blocks)
    first = last = None
    before = 0
    for number, real in enumerate(blocks):
        low, high = max(start, number * size), min(stop, number * size + real)
        if low < high:
            first = before + low - number * size if first is None else first
            last = before + high - number * size
        before += real
    return None if first is None else (first, last)


def _device_name(device):
    return f"{device.platform}:{device.id}"


def describe_trainer(trainer, batch=None, x=None, y=None, sample_weight=None):
    """`ShardedTrainer.describe`: the mesh, the state's layout, a batch's, the data's home.

    The state from its variables' shapes and layout (nothing copied to the
    devices), where the model is built; `batch` placed as a step would take
    it; with `x`, whether a fit keeps that data on the devices.
    """
    state = (TrainState.abstract_of(trainer.model, trainer.state_layout())
             if build.is_built(trainer.model) else None)
    device_batch = None if batch is None else trainer.shard(batch)
    text = describe(trainer.layout, state, device_batch, trainer.hosts.host_names(),
                    trainer.steps_per_execution,
                    None if state is None else TrainState.variables_of(trainer.model))
    if x is None:
        return text
    batches = trainer.batches_of(inputs.model_inputs(x, y, trainer.model), y, sample_weight,
                                 None, False)
    keep, why_not = feed.decide(batches, choice=trainer.data_on_device, layout=trainer.layout,
                                hosts=trainer.hosts)
    nbytes = 0 if batches.arrays is None else feed.data_bytes(batches.arrays)
    return text + "\n" + data_line(batches.num_samples, nbytes, trainer.num_devices, keep,
                                   why_not)
