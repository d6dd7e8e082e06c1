"""Devices and shardings: the 1-D `"batch"` mesh and where arrays live on it.

Every sharding keras_dp places arrays with comes from this module: model state is
*replicated* (`PartitionSpec()`, a full copy on every device) unless
`state_sharding` splits it (`keras_dp.layout` gives those shardings), and
each batch is *sharded* along its leading axis over the mesh axis `"batch"`.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from keras_dp import distributed

BATCH_AXIS = "batch"


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


def check_keras_distribution():
    """Refuse a Keras distribution whose layout keras_dp would ignore.

    keras_dp lays out every variable itself (replicated, or split as
    `state_sharding` says) and splits each batch over its own mesh. Under
    `keras.distribution.DataParallel` that is what Keras would do too; any
    other distribution (`ModelParallel`'s sharded variables) would be
    silently replaced by keras_dp's layout, so it is refused: when a trainer
    is made, and again when it builds the model (first in `fit`, `evaluate`
    and `predict`) or runs a step by hand, since a distribution set after
    the trainer was made would lay out the variables the build creates and
    add its own layout constraints to the step's trace.

    Raises:
        ValueError: a distribution other than `DataParallel` is set.
    """
    import keras  # noqa: PLC0415  (keras_dp sets the backend before Keras loads)

    current = keras.distribution.distribution()
    if current is not None and not isinstance(current, keras.distribution.DataParallel):
        raise ValueError(
            "keras_dp trains with data parallelism only: it lays out every "
            "variable itself (a full copy on every device, or split over them "
            "by state_sharding) and ignores Keras layouts. "
            f"Received: a {type(current).__name__} distribution, set with "
            "keras.distribution.set_distribution() or entered with "
            "`with distribution.scope():`. Call keras_dp outside that scope, "
            "after keras.distribution.set_distribution(None) (a model created "
            "under it trains as well), with state_sharding='full' if its "
            "variables must be split over the devices to fit; or train a "
            "model-parallel layout with Keras's own model.fit."
        )


def replicated(mesh):
    """The sharding that keeps a full copy of an array on every device."""
    return NamedSharding(mesh, PartitionSpec())


def batch_sharded(mesh):
    """The sharding that splits an array's leading axis across `"batch"`."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXIS))


def stacked_batch_sharded(mesh):
    """For `[steps, batch, ...]` stacks: steps whole, rows split over `"batch"`."""
    return NamedSharding(mesh, PartitionSpec(None, BATCH_AXIS))


def place(tree, mesh, shardings, same_on_every_process=False):
    """Copy every array of `tree` onto `mesh`, laid out as `shardings`.

    Each value is first copied where it lies (a `jax.Array` on its device,
    with no trip through the host; a numpy array on the host): `jax.device_put`
    may alias its argument's buffer, even with `may_alias=False`, and the
    train step donates the state, so without the copy donation would delete
    the Keras variables it came from.

    When `mesh` spans several processes, every process gets process 0's
    values (one broadcast, through the host), unless the caller vouches
    that they are already the same everywhere (`same_on_every_process`,
    for example metrics' reset values): then there is no broadcast.

    Args:
        tree: arrays (numpy, or `jax.Array`s anywhere).
        mesh: the `"batch"` mesh.
        shardings: one sharding for all, or a tree of shardings matching
            `tree` (see `keras_dp.layout`).
        same_on_every_process: the values are known to be equal in every
            process, so no broadcast is needed.

    Returns:
        A tree of the same structure whose leaves are `jax.Array`s with
        the given shardings.
    """
    if not spans_processes(mesh):
        return jax.device_put(_fresh_copies(tree), shardings)
    if not same_on_every_process:
        # Each process places its own values on its own devices: take process
        # 0's, so that replicas on different hosts can never start apart
        # (different seeds, a callback run on one host).
        from jax.experimental import multihost_utils

        host = jax.tree.map(lambda value: np.array(value, copy=True), tree)
        tree = multihost_utils.broadcast_one_to_all(host)
    return _from_equal_values(tree, shardings)


def _from_equal_values(tree, shardings):
    """Global arrays from values equal on every process, each placing its own devices' parts.

    `jax.device_put` would check that they are equal by gathering every
    value from every process through the hosts (`multihost_utils.assert_equal`):
    a blocking host collective per array, where the caller knows they are.
    """
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, tree)

    def put(value, sharding):
        value = np.array(value, copy=True)
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    return jax.tree.map(put, tree, shardings)


def _fresh_copies(tree):
    """`tree` with every array copied where it lies: numpy on the host, `jax.Array`s on device.

    The `jax.Array`s are copied by one compiled program per sharding they
    have (one for a model's variables, usually): `jnp.copy` on each would
    compile a program per distinct shape, 13 for the guide's convnet and
    its optimizer, each time a process starts.
    """
    leaves, treedef = jax.tree.flatten(tree)
    by_sharding = {}
    for index, value in enumerate(leaves):
        if isinstance(value, jax.Array):
            by_sharding.setdefault(value.sharding, []).append(index)
        else:
            leaves[index] = np.array(value, copy=True)
    for indices in by_sharding.values():
        copies = _copy_all([leaves[index] for index in indices])
        for index, copy in zip(indices, copies):
            leaves[index] = copy
    return treedef.unflatten(leaves)


# New buffers on the arrays' own devices (no donation: the inputs stay valid).
_copy_all = jax.jit(lambda arrays: [jnp.copy(array) for array in arrays])


def local_copy(array, like=None):
    """A fresh single-device copy of a state array, made on the device.

    A replicated array: copies one local shard on its device (no trip
    through the host); a split one (`keras_dp.layout`) is gathered. Then
    moves it to `like`'s sharding when `like` (the Keras variable's current
    value) lies elsewhere. The result shares no buffer with `array`, so
    donating `array` later leaves it intact. A numpy array is copied as it is.
    """
    return local_copies([array], [like])[0]


def local_copies(arrays, likes):
    """`local_copy(array, like)` of each pair, the replicated arrays in one compiled program.

    What write-back copies: `jnp.copy` on each would compile a program per
    distinct shape (13 for the convnet's state) in every process; one
    program copies a device's shards together.
    """
    copies = [None] * len(arrays)
    shards = {}  # position -> one local shard of a replicated array
    for position, (array, like) in enumerate(zip(arrays, likes, strict=True)):
        if not isinstance(array, jax.Array):
            copies[position] = np.array(array, copy=True)
        elif array.sharding.is_fully_replicated:
            shards[position] = array.addressable_data(0)
        else:  # split (`state_sharding`): gather it
            copies[position] = _gathered_copy(array, like)
    for position, copy in zip(shards, _fresh_copies(list(shards.values()))):
        like = likes[position]
        if isinstance(like, jax.Array) and like.sharding != copy.sharding:
            copy = jax.device_put(copy, like.sharding)
        copies[position] = copy
    return copies


def _gathered_copy(array, like):
    """A whole single-device copy of a split array, gathered device to device."""
    if not array.is_fully_addressable:  # split over processes: through the hosts
        from jax.experimental import multihost_utils

        return jnp.asarray(multihost_utils.process_allgather(array, tiled=True))
    target = like.sharding if isinstance(like, jax.Array) else jax.sharding.SingleDeviceSharding(
        array.addressable_shards[0].device)
    return jnp.copy(jax.device_put(array, target))


def spans_processes(mesh):
    """Whether `mesh` has devices of more than one process."""
    return len({device.process_index for device in mesh.devices.flat}) > 1


def num_devices(mesh):
    """The number of devices along the `"batch"` axis."""
    return mesh.shape[BATCH_AXIS]


def on_cpu(mesh):
    """Whether the mesh's devices are XLA:CPU's (simulated or not), not accelerators."""
    return mesh.devices.flat[0].platform == "cpu"
