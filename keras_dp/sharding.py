"""Where every array lives: the mesh, its batch axis, the state's layout, a batch's rows.

A `Layout` is one trainer's answer to "where": a named `jax.sharding.Mesh`,
the name of its batch axis, and the rule that places each state variable
(`state_sharding`). Everything else in keras_dp asks a `Layout`, so nothing
outside this module assumes the mesh has one axis or that its batch axis is
called `"batch"`. Axes other than the batch axis hold replicas today.

The state rule (`variable_sharding`) has three modes:

- `"replicated"` (the default): every device holds the whole state.
- `"optimizer"` (ZeRO-1/2): optimizer slots and metric accumulators are
  split over the batch axis; the gradients are constrained to the same
  split, so each device updates only its slice of the weights, and the new
  weights are all-gathered back (they stay replicated). XLA's partitioner
  sums each split gradient as an all-reduce followed by each device's
  slice; XLA's GPU pipeline fuses the pair into a reduce-scatter, XLA:CPU's
  keeps it (tests/test_layout.py reads the HLO).
- `"full"` (FSDP / ZeRO-3): the weights and non-trainable variables are
  split too; XLA all-gathers each one inside the compiled step where a
  layer needs it.

Which variables are split, and along which dimension: a floating-point
variable of at least `MIN_SPLIT_SIZE` elements is split along its largest
dimension that the batch axis divides (the last such on a tie); smaller
variables (biases, BatchNorm parameters, scalars, seed-generator states)
and variables with no dimension that divides stay replicated, since
splitting them saves little and costs a collective. Nothing is padded. The
layout is a pure function of the variables' shapes, so the host (placing
the state) and every compiled step (constraining it) agree on it. The
split changes where numbers live, not what is computed: every mode gives
the same steps as `"replicated"` up to float summation order.

A global batch of any size goes on the mesh (`DeviceBatch`): the host pads
its rows (repeating the last row) to a multiple of the batch axis's size,
the only split `jax.device_put` accepts, and records the real row count as
a static part of the batch. Inside a compiled step, `real_rows` cuts the
padding off again, so the model, its loss, BatchNorm's batch statistics and
the metrics all see exactly the real rows, split unevenly over the devices:
XLA's SPMD partitioner masks the missing rows out of every reduction. No
row is dropped, none is invented, and no model needs a mask.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from keras_dp import distributed
from keras_dp._messages import short_list

# The batch axis of the mesh keras_dp makes (`make_mesh`).
BATCH_AXIS = "batch"
MODES = ("replicated", "optimizer", "full")
# Below this many elements a variable stays replicated (16 KiB in float32).
MIN_SPLIT_SIZE = 4096
_SPLIT_GROUPS = {
    "replicated": (),
    "optimizer": ("optimizer", "metrics"),
    "full": ("trainable", "non_trainable", "optimizer", "metrics"),
}


def make_mesh(devices=None, mesh=None):
    """Return the 1-D data-parallel mesh with the single axis `"batch"`.

    Args:
        devices: the devices to train on, each once; all of JAX's devices
            when `None`.
        mesh: a user's own mesh, a `jax.sharding.Mesh` or a
            `keras.distribution.DeviceMesh`; it must have exactly one axis,
            which is taken as the batch axis whatever its name (`"data"`
            too). Mutually exclusive with `devices`.

    Returns:
        A `Mesh` with the one axis `"batch"` of type `AxisType.Auto` (Keras's
        Dropout fails under explicit-sharding axes): a user's `Auto` mesh
        named `"batch"` itself, else one over the same devices in the same
        order (`jax.make_mesh` makes `Explicit` axes by default).

    Raises:
        ValueError: both arguments given, an empty device list, a device
            listed twice, or a mesh with more than one axis.
        RuntimeError: the `KERAS_DP_*` variables ask for several processes
            (`keras-dp launch`), but `keras_dp.distributed.initialize()`
            was not called (`keras_dp.distributed.check_joined`).
    """
    distributed.check_joined()
    if mesh is not None:
        if devices is not None:
            raise ValueError(
                "Pass either `mesh` or `devices`, not both. Received: "
                f"mesh={mesh}, devices={devices}."
            )
        return _users_mesh(mesh)
    given = devices
    devices = jax.devices() if devices is None else list(np.asarray(devices, dtype=object).flat)
    if not devices:
        raise ValueError("`devices` is empty. Pass at least one JAX device.")
    if not all(isinstance(device, jax.Device) for device in devices):
        raise ValueError(
            "`devices` is a list of JAX devices, not a count or ids. Received: "
            f"devices={given!r}. Pass, for example, devices=jax.devices()[:2]."
        )
    twice = sorted({str(device) for device in devices if devices.count(device) > 1})
    if twice:
        raise ValueError(
            "Each device may appear once: a device listed twice would hold two "
            f"shards of every batch. Received: {', '.join(twice)} more than once "
            f"in devices={devices}. Pass distinct devices, for example jax.devices()[:n]."
        )
    return Mesh(
        np.asarray(devices), (BATCH_AXIS,), axis_types=(AxisType.Auto,)
    )


def _users_mesh(mesh):
    """A user's 1-D mesh, checked, as a `jax.sharding.Mesh` with an `Auto` `"batch"` axis."""
    if not isinstance(mesh, Mesh) and hasattr(mesh, "axis_names") and hasattr(mesh, "devices"):
        # A keras.distribution.DeviceMesh: its devices in its shape.
        mesh = Mesh(np.asarray(mesh.devices).reshape(tuple(mesh.shape)), tuple(mesh.axis_names))
    if not isinstance(mesh, Mesh):
        raise ValueError(
            "`mesh` is a jax.sharding.Mesh or a keras.distribution.DeviceMesh. "
            f"Received: mesh={mesh!r} of type {type(mesh).__name__}. "
            "Pass devices=[...] instead, or build one with keras_dp.make_mesh(devices)."
        )
    if len(mesh.axis_names) != 1:
        raise ValueError(
            "keras_dp needs a 1-D mesh: its single axis splits the batch. "
            f"Received: mesh.axis_names={mesh.axis_names}. Build one with "
            f"keras_dp.make_mesh(devices) or jax.make_mesh((n,), ('{BATCH_AXIS}',)), "
            "or pass devices=list(mesh.devices.flat) to train on the same devices."
        )
    # One axis, whatever its name (("data",), ("dp",)): it can only be the
    # batch axis. keras_dp's shardings name it "batch", over the same devices.
    if tuple(mesh.axis_names) != (BATCH_AXIS,) or tuple(mesh.axis_types) != (AxisType.Auto,):
        return Mesh(mesh.devices, (BATCH_AXIS,), axis_types=(AxisType.Auto,))
    return mesh


def check_mode(state_sharding):
    """Return `state_sharding` if it is one of `MODES`.

    Raises:
        ValueError: an unknown mode.
    """
    if state_sharding not in MODES:
        raise ValueError(
            f"`state_sharding` must be one of {', '.join(map(repr, MODES))}. "
            f"Received: state_sharding={state_sharding!r}."
        )
    return state_sharding


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a trainer's arrays live: `mesh`, its `batch_axis`, and the state's rule.

    Batches split their rows over `batch_axis` and are replicated over the
    mesh's other axes; state variables are replicated, or split over
    `batch_axis` where `state_sharding` says (see the module doc).

    Attributes:
        mesh: a `jax.sharding.Mesh` of any number of named axes.
        state_sharding: one of `MODES`.
        batch_axis: the name of the axis each batch's rows split over.
    """

    mesh: Mesh
    state_sharding: str = "replicated"
    batch_axis: str = BATCH_AXIS

    def __post_init__(self):
        check_mode(self.state_sharding)
        if self.batch_axis not in self.mesh.axis_names:
            raise ValueError(
                f"The batch axis {self.batch_axis!r} is not an axis of the mesh. "
                f"Received: mesh.axis_names={self.mesh.axis_names}.")

    @property
    def batch_shards(self):
        """How many parts each global batch splits into: the batch axis's size."""
        return self.mesh.shape[self.batch_axis]

    @property
    def devices(self):
        """The mesh's devices, in mesh order."""
        return list(self.mesh.devices.flat)

    @property
    def on_cpu(self):
        """Whether the mesh's devices are XLA:CPU's (simulated or not), not accelerators."""
        return on_cpu(self.mesh)

    @property
    def spans_processes(self):
        """Whether the mesh has devices of more than one process."""
        return spans_processes(self.mesh)

    @property
    def replicated(self):
        """The sharding that keeps a full copy of an array on every device."""
        return replicated(self.mesh)

    @property
    def batch(self):
        """The sharding that splits an array's leading axis over the batch axis."""
        return NamedSharding(self.mesh, PartitionSpec(self.batch_axis))

    @property
    def stacked_batch(self):
        """For `[steps, batch, ...]` stacks: steps whole, rows split over the batch axis."""
        return NamedSharding(self.mesh, PartitionSpec(None, self.batch_axis))

    def variable_sharding(self, shape, dtype, split=True):
        """The `NamedSharding` of one variable (see the module doc).

        Args:
            shape, dtype: the variable's.
            split: whether this variable's group is split in the current mode.
        """
        shards = self.batch_shards
        # jnp's issubdtype, not numpy's: numpy counts no ml_dtypes type
        # (bfloat16, float8_*) as floating, and a "bfloat16" model's weights
        # would then all stay replicated.
        if (not split or shards == 1 or not jnp.issubdtype(dtype, jnp.floating)
                or int(np.prod(shape, dtype=np.int64)) < MIN_SPLIT_SIZE):
            return self.replicated
        candidates = [axis for axis, size in enumerate(shape) if size % shards == 0]
        if not candidates:
            return self.replicated
        axis = max(candidates, key=lambda axis: (shape[axis], axis))
        spec = [None] * len(shape)
        spec[axis] = self.batch_axis
        return NamedSharding(self.mesh, PartitionSpec(*spec))

    def state_shardings(self, state):
        """The sharding of every array of `state` (a `TrainState`).

        `state`'s leaves need only `shape` and `dtype` (arrays, Keras
        variables or `jax.ShapeDtypeStruct`s). Returns a `TrainState` of lists
        of `NamedSharding`, in the same order; a `None` group stays `None`.
        """
        return type(state)(*(
            None if values is None else self.group_shardings(values, name)
            for name, values in zip(state._fields, state)
        ))

    def group_shardings(self, values, group):
        """The shardings of one state group's arrays (`group`: "trainable", ...)."""
        split = group in _SPLIT_GROUPS[self.state_sharding]
        return [self.variable_sharding(v.shape, v.dtype, split) for v in values]

    def gradient_shardings(self, trainable):
        """Where the gradients of `trainable` go before the optimizer update.

        Split like a weight of that shape would be in any mode but
        `"replicated"` (None then: the gradients stay replicated, one
        all-reduce). Constraining a gradient to a split layout leaves each
        device the sum of its slice only: a reduce-scatter where XLA's
        pipeline forms one (GPU), an all-reduce and a slice on XLA:CPU.
        """
        if self.state_sharding == "replicated":
            return None
        return [self.variable_sharding(v.shape, v.dtype, True) for v in trainable]


def replicated(mesh):
    """The sharding that keeps a full copy of an array on every device of `mesh`."""
    return NamedSharding(mesh, PartitionSpec())


def spans_processes(mesh):
    """Whether `mesh` has devices of more than one process."""
    return len({device.process_index for device in mesh.devices.flat}) > 1


def on_cpu(mesh):
    """Whether the mesh's devices are XLA:CPU's (simulated or not), not accelerators."""
    return mesh.devices.flat[0].platform == "cpu"


def constrain(tree, shardings):
    """Inside a compiled step: `tree` laid out as `shardings` (None: as it is)."""
    if shardings is None:
        return tree
    return jax.lax.with_sharding_constraint(tree, shardings)


def bytes_per_device(array):
    """The bytes one device holds of `array` (a `jax.Array`, or a `jax.ShapeDtypeStruct` with a sharding).

    Exact for this module's layouts, which split a dimension only where
    the batch axis divides it.
    """
    shard = array.sharding.shard_shape(array.shape)
    return int(np.prod(shard, dtype=np.int64)) * np.dtype(array.dtype).itemsize


# -- A global batch on the mesh ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DeviceBatch:
    """A global batch on the mesh, its rows padded to split evenly.

    Attributes:
        data: the batch's tree of `jax.Array`s; each has `rows` real rows
            followed by copies of the last one, up to the next multiple of
            the batch axis's size, split over the batch axis.
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


def check_device_batch(batch, caller="trainer.train_step"):
    """Refuse a batch that is not on the mesh yet, naming the fix.

    Raises:
        TypeError: `batch` is not a `DeviceBatch`.
    """
    if not isinstance(batch, DeviceBatch):
        raise TypeError(
            f"{caller} takes a batch placed on the mesh (a keras_dp DeviceBatch). "
            f"Received: batch of type {type(batch).__name__}. Place it first: "
            f"{caller}(state, trainer.shard(batch)).")


def batch_rows(batch):
    """The number of rows of a batch, checking that every array agrees.

    Raises:
        ValueError: arrays with different leading sizes, or no arrays.
    """
    leaves = jax.tree.leaves(batch)
    if not leaves:
        raise ValueError("A batch holds no arrays. Each batch needs at least x.")
    sizes = {np.shape(leaf)[0] if np.ndim(leaf) else None for leaf in leaves}
    if len(sizes) != 1 or None in sizes:
        shapes = short_list([np.shape(leaf) for leaf in leaves])
        raise ValueError(
            "Every array of a batch must have the same number of rows (its "
            f"first dimension). Received arrays of shapes {shapes}. Check "
            "that x, y and sample_weight have one entry per sample."
        )
    return sizes.pop()


def to_device(batch, layout):
    """Place a host batch (any tree of arrays) on `layout`'s mesh, split by rows.

    Returns:
        A `DeviceBatch`. Padding repeats the last real row, so that the
        padded rows are values the model already handles; they never reach
        a result (see `real_rows`).

    Raises:
        ValueError: a batch without rows.
    """
    rows = batch_rows(batch)
    if rows == 0:
        raise ValueError(
            "A batch with no rows cannot be placed: a step needs at least one "
            "sample. Check the slice that made it (for example x[start:stop] "
            "past the end of the data)."
        )
    batch = pad_rows(batch, padded_rows(rows, layout))
    return DeviceBatch(jax.device_put(batch, layout.batch), rows)


def to_device_stacked(batches, layout):
    """Place K host batches of equal row count on `layout`'s mesh as one stack.

    Returns:
        A `DeviceBatch` whose arrays have shape `[K, padded_rows, ...]`,
        sharded `PartitionSpec(None, batch_axis)`: every device holds its
        rows of all K batches, for a multi-step program to scan over.
    """
    rows = batch_rows(batches[0])
    if any(batch_rows(batch) != rows for batch in batches):
        raise ValueError(f"Stacked batches must all have {rows} rows.")
    padded = [pad_rows(batch, padded_rows(rows, layout)) for batch in batches]
    stack = jax.tree.map(lambda *arrays: np.stack(arrays), *padded)
    return DeviceBatch(jax.device_put(stack, layout.stacked_batch), rows)


def padded_rows(rows, layout):
    """The length of a placed batch of `rows` real rows: the next multiple of the batch shards."""
    return rows + -rows % layout.batch_shards


def pad_rows(batch, size):
    """`batch` grown to `size` rows with copies of its last row."""
    def pad(array):
        extra = size - array.shape[0]
        return np.concatenate([array, np.repeat(array[-1:], extra, axis=0)]) if extra else array

    return jax.tree.map(pad, batch)


def abstract_batch(data, rows, layout, steps=1, drop=1):
    """The `DeviceBatch` of a call of `steps` batches of `rows` rows, as abstract arrays.

    What `to_device` (`steps` 1) or `to_device_stacked` would make of
    batches like `data`, whose first `drop` axes (its rows, after its
    steps if stacked) are replaced by the call's: padded and split over
    the mesh, in JAX's dtypes (int64 becomes int32 unless x64 is on), for
    `jitted.lower` without placing anything.
    """
    lead, placed = (padded_rows(rows, layout),), layout.batch
    if steps > 1:
        lead, placed = (steps,) + lead, layout.stacked_batch

    def like(array):
        return jax.ShapeDtypeStruct(
            lead + tuple(array.shape[drop:]), jax.dtypes.canonicalize_dtype(array.dtype),
            sharding=placed, weak_type=getattr(array, "weak_type", False))

    return DeviceBatch(jax.tree.map(like, data), rows)


def real_rows(batch, layout):
    """Inside a compiled step: the real rows of a `DeviceBatch`.

    The padding is cut off and the rows stay split over the batch axis
    (unevenly when they do not divide), so every computation that follows,
    means and BatchNorm statistics included, is over exactly the real rows.
    """
    return jax.tree.map(
        lambda array: jax.lax.with_sharding_constraint(_cut(array, batch), layout.batch),
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


