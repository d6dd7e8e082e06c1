"""Where every array lives: the mesh, its batch axis, the state's layout, a batch's rows.

A `Layout` is one trainer's answer to "where": a named `jax.sharding.Mesh`
of any number of axes, the name of its batch axis, the layout Keras's
distribution gives each variable (`bases`: `keras_dp.keras.layouts`), and
the rule that splits the state further (`state_sharding`). Everything else
in keras_dp asks a `Layout`, so nothing outside this module assumes the
mesh has one axis or that its batch axis is called `"batch"`.

The state rule, written once here (`Layout.variable_sharding`): each
variable starts from its base layout (replicated without a Keras
distribution; a `ModelParallel` layout map's entry otherwise, kept as it
is), and `state_sharding` decides which groups are also split over the
batch axis:

- `"replicated"` (the default): nothing more; without a distribution every
  device holds the whole state.
- `"optimizer"` (ZeRO-1/2): optimizer slots and metric accumulators; the
  gradients are constrained to the same split, so each device updates only
  its slice of the weights, and the new weights are all-gathered back to
  their base layout. XLA's partitioner sums each split gradient as an
  all-reduce followed by each device's slice (XLA's GPU pipeline fuses the
  pair into a reduce-scatter; tests/test_layout.py reads the HLO).
- `"full"` (FSDP / ZeRO-3): the weights and non-trainable variables too;
  XLA all-gathers each one inside the compiled step where a layer needs it.

A variable of a split group whose base does not use the batch axis gets it
on its largest free dimension (one the base leaves whole) that the batch
axis divides, the last such on a tie, if it is floating-point and has at
least `MIN_SPLIT_SIZE` elements; a base that already uses the batch axis
(Gemma's layout map does) stays as it is. Smaller variables (biases,
norms, scalars, seed states) stay as their base says: splitting them saves
little and costs a collective. Nothing is padded. The layout is a pure
function of the variables' shapes and bases, so the host (placing the
state) and every compiled step (constraining it) agree on it, and it
changes where numbers live, not what is computed.

A global batch of any size goes on the mesh (`DeviceBatch`): the host pads
its rows (repeating the last row) to a multiple of the batch axis's size,
the only split `jax.device_put` accepts, and records the real row count as
a static part of the batch; the rows split over the batch axis and are
replicated over the mesh's other axes. Inside a compiled step, `real_rows`
cuts the padding off again, so the model, its loss, BatchNorm's batch
statistics and the metrics all see exactly the real rows, split unevenly
over the devices: XLA's SPMD partitioner masks the missing rows out of
every reduction. No row is dropped, none is invented, and no model needs a
mask.
"""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from keras_dp._messages import short_list
# `make_mesh` is public as `keras_dp.make_mesh`; here too for the modules that use it.
from keras_dp.mesh import BATCH_AXIS
from keras_dp.mesh import make_mesh  # noqa: F401
MODES = ("replicated", "optimizer", "full")
# Below this many elements a variable stays replicated (16 KiB in float32).
MIN_SPLIT_SIZE = 4096
_SPLIT_GROUPS = {
    "replicated": (),
    "optimizer": ("optimizer", "metrics"),
    "full": ("trainable", "non_trainable", "optimizer", "metrics"),
}


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
    """Where a trainer's arrays live: `mesh`, its `batch_axis`, the variables' bases, the state rule.

    Batches split their rows over `batch_axis` and are replicated over the
    mesh's other axes; each state variable is laid out by its base, split
    further over `batch_axis` where `state_sharding` says (see the module
    doc).

    Attributes:
        mesh: a `jax.sharding.Mesh` of any number of named axes.
        state_sharding: one of `MODES`.
        batch_axis: the name of the axis each batch's rows split over.
        bases: where Keras's distribution puts each variable, or None
            (every variable's base is replicated): an object whose
            `specs(group, count)` gives the `PartitionSpec`s of the
            group's `count` variables in order (None: all replicated),
            and whose `scope()` is the context the steps are traced in
            (`keras_dp.keras.layouts.VariableLayouts`).
    """

    mesh: Mesh
    state_sharding: str = "replicated"
    batch_axis: str = BATCH_AXIS
    bases: object = None

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
        return self.mesh.devices.flat[0].platform == "cpu"

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

    def tracing(self):
        """The context the compiled steps are traced in: the Keras distribution's scope, if any.

        Keras's layers then add the layout map's constraints on their
        outputs (keys ending in `/output`), as under Keras's own `fit`.
        """
        scope = getattr(self.bases, "scope", None)
        return scope() if scope is not None else contextlib.nullcontext()

    def variable_sharding(self, shape, dtype, split=True, base=None):
        """The `NamedSharding` of one variable: the state rule (see the module doc).

        Args:
            shape, dtype: the variable's.
            split: whether this variable's group is split in the current mode.
            base: its base `PartitionSpec` (None: replicated).
        """
        spec = list(base or ()) + [None] * (len(shape) - len(base or ()))
        shards = self.batch_shards
        # jnp's issubdtype, not numpy's: numpy counts no ml_dtypes type
        # (bfloat16, float8_*) as floating, and a "bfloat16" model's weights
        # would then all stay replicated.
        if (split and shards > 1 and self.batch_axis not in axes_of(spec)
                and jnp.issubdtype(dtype, jnp.floating)
                and int(np.prod(shape, dtype=np.int64)) >= MIN_SPLIT_SIZE):
            free = [axis for axis, (entry, size) in enumerate(zip(spec, shape))
                    if entry is None and size % shards == 0]
            if free:
                spec[max(free, key=lambda axis: (shape[axis], axis))] = self.batch_axis
        if not any(spec):  # PartitionSpec() for a replicated array
            return self.replicated
        return NamedSharding(self.mesh, PartitionSpec(*spec))

    def base_specs(self, group, count):
        """The base `PartitionSpec`s of a state group's `count` variables (None: replicated)."""
        specs = None if self.bases is None else self.bases.specs(group, count)
        return [None] * count if specs is None else list(specs)

    def state_shardings(self, state):
        """The sharding of every array of `state` (a `TrainState`).

        `state`'s leaves need only `shape` and `dtype` (arrays, Keras
        variables or `jax.ShapeDtypeStruct`s), in the order of the model's
        variables (the bases are matched by position). Returns a
        `TrainState` of lists of `NamedSharding`, in the same order; a
        `None` group stays `None`.
        """
        return type(state)(*(
            None if values is None else self.group_shardings(values, name)
            for name, values in zip(state._fields, state)
        ))

    def group_shardings(self, values, group):
        """The shardings of one state group's arrays (`group`: "trainable", ...)."""
        split = group in _SPLIT_GROUPS[self.state_sharding]
        return [self.variable_sharding(v.shape, v.dtype, split, base)
                for v, base in zip(values, self.base_specs(group, len(values)))]

    def gradient_shardings(self, trainable):
        """Where the gradients of `trainable` go before the optimizer update.

        Laid out as a weight of the `"full"` mode would be in any mode but
        `"replicated"`; in `"replicated"`, as the weights' bases (None
        when those are all replicated: the gradients stay replicated, one
        all-reduce). Constraining a gradient to a split layout leaves each
        device the sum of its slice only: a reduce-scatter where XLA's
        pipeline forms one (GPU), an all-reduce and a slice on XLA:CPU.
        """
        split = self.state_sharding != "replicated"
        shardings = [self.variable_sharding(v.shape, v.dtype, split, base)
                     for v, base in zip(trainable, self.base_specs("trainable", len(trainable)))]
        return shardings if split or splits(shardings) else None


def axes_of(spec):
    """The mesh axes a `PartitionSpec` (or a list of its entries) uses, in order."""
    axes = []
    for entry in spec:
        axes.extend(() if entry is None else (entry,) if isinstance(entry, str) else entry)
    return axes


def indivisible(mesh, shape, spec):
    """The first dimension `spec` splits unevenly on `mesh`: `(dim, axes, parts)`, or None.

    JAX places only even splits: a dimension of size 5 cannot be split over
    an axis of 2.
    """
    for dim, entry in enumerate(spec):
        axes = axes_of([entry])
        parts = int(np.prod([mesh.shape[axis] for axis in axes], dtype=np.int64))
        if dim >= len(shape) or shape[dim] % parts:
            return dim, axes, parts
    return None


def splits(shardings):
    """Whether any of `shardings` splits its array (is not fully replicated)."""
    return any(not sharding.is_fully_replicated for sharding in jax.tree.leaves(shardings))


def replicated(mesh):
    """The sharding that keeps a full copy of an array on every device of `mesh`."""
    return NamedSharding(mesh, PartitionSpec())


def spans_processes(mesh):
    """Whether `mesh` has devices of more than one process."""
    return len({device.process_index for device in mesh.devices.flat}) > 1


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


