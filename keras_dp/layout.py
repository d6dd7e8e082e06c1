"""Where each variable of the training state lives: `state_sharding`.

Three modes, all on the one `"batch"` mesh:

- `"replicated"` (the default): every device holds the whole state.
- `"optimizer"` (ZeRO-1/2): optimizer slots and metric accumulators are
  split over `"batch"`; the gradients are constrained to the same split, so
  each device updates only its slice of the weights, and the new weights
  are all-gathered back to every device (they stay replicated). XLA's
  partitioner sums each split gradient as an all-reduce followed by each
  device's slice; XLA's GPU pipeline fuses the pair into a reduce-scatter,
  XLA:CPU's keeps it (tests/test_layout.py reads the HLO).
- `"full"` (FSDP / ZeRO-3): the weights and non-trainable variables are
  split too; XLA all-gathers each one inside the compiled step where a
  layer needs it.

Which variables are split, and along which axis (`variable_sharding`): a
floating-point variable of at least `MIN_SPLIT_SIZE` elements is split along
its largest dimension that divides by the device count (the last such on a
tie); smaller variables (biases, BatchNorm parameters, scalars, seed-generator
states) and variables with no dimension that divides stay replicated, since
splitting them saves little and costs a collective. Nothing is padded. The
layout is a pure function of the variables' shapes, so the host (placing the
state) and every compiled step (constraining it) agree on it.

The split changes where numbers live, not what is computed: every mode gives
the same steps as `"replicated"` up to float summation order.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from keras_dp import sharding as mesh_lib

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

    (A mesh with more than one axis never gets here: `mesh.make_mesh`
    refuses it with a message for every mode, and names a 1-D mesh's axis
    `"batch"`.)

    Raises:
        ValueError: an unknown mode.
    """
    if state_sharding not in MODES:
        raise ValueError(
            f"`state_sharding` must be one of {', '.join(map(repr, MODES))}. "
            f"Received: state_sharding={state_sharding!r}."
        )
    return state_sharding


def variable_sharding(shape, dtype, mesh, split=True):
    """The `NamedSharding` of one variable (see the module docstring).

    Args:
        shape, dtype: the variable's.
        mesh: the `"batch"` mesh.
        split: whether this variable's group is split in the current mode.
    """
    devices = mesh_lib.num_devices(mesh)
    # jnp's issubdtype, not numpy's: numpy counts no ml_dtypes type
    # (bfloat16, float8_*) as floating, and a "bfloat16" model's weights
    # would then all stay replicated.
    if (not split or devices == 1 or not jnp.issubdtype(dtype, jnp.floating)
            or int(np.prod(shape, dtype=np.int64)) < MIN_SPLIT_SIZE):
        return mesh_lib.replicated(mesh)
    candidates = [axis for axis, size in enumerate(shape) if size % devices == 0]
    if not candidates:
        return mesh_lib.replicated(mesh)
    axis = max(candidates, key=lambda axis: (shape[axis], axis))
    spec = [None] * len(shape)
    spec[axis] = mesh_lib.BATCH_AXIS
    return NamedSharding(mesh, PartitionSpec(*spec))


def state_shardings(state, mesh, mode):
    """The sharding of every array of `state` (a `TrainState`) under `mode`.

    `state`'s leaves need only `shape` and `dtype` (arrays, Keras variables
    or `jax.ShapeDtypeStruct`s). Returns a `TrainState` of lists of
    `NamedSharding`, in the same order; a `None` group stays `None`.
    """
    return type(state)(*(
        None if values is None else group_shardings(values, mesh, mode, name)
        for name, values in state.groups()
    ))


def group_shardings(values, mesh, mode, group):
    """The shardings of one state group's arrays (`group`: "trainable", ...)."""
    split = group in _SPLIT_GROUPS[mode]
    return [variable_sharding(v.shape, v.dtype, mesh, split) for v in values]


def gradient_shardings(trainable, mesh, mode):
    """Where the gradients of `trainable` go before the optimizer update.

    Split like a weight of that shape would be in any mode but
    `"replicated"` (None then: the gradients stay replicated, one
    all-reduce). Constraining a gradient to a split layout leaves each
    device the sum of its slice only: a reduce-scatter where XLA's pipeline
    forms one (GPU), an all-reduce and a slice on XLA:CPU.
    """
    if mode == "replicated":
        return None
    return [variable_sharding(v.shape, v.dtype, mesh, True) for v in trainable]


def constrain(tree, shardings):
    """Inside a compiled step: `tree` laid out as `shardings` (None: as it is)."""
    if shardings is None:
        return tree
    return jax.lax.with_sharding_constraint(tree, shardings)


def bytes_per_device(array):
    """The bytes one device holds of `array` (a `jax.Array`, or a `jax.ShapeDtypeStruct` with a sharding).

    Exact for this module's layouts, which split a dimension only where
    the device count divides it.
    """
    shard = array.sharding.shard_shape(array.shape)
    return int(np.prod(shard, dtype=np.int64)) * np.dtype(array.dtype).itemsize
