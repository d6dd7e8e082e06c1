"""Copies onto and off the mesh that never alias what they came from: `place` and `local_copies`.

The train step donates its state, and `jax.device_put` may alias its
argument's buffer; so every array keras_dp puts on the mesh (`place`) is
first copied where it lies, and every value written back into a Keras
variable (`local_copies`) is a fresh copy made device to device. Across
processes, `place` gives every process process 0's values, and a state
split across processes is gathered through the hosts.
"""

import jax
import jax.numpy as jnp
import numpy as np

from keras_dp import sharding


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
    if not sharding.spans_processes(mesh):
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
    split = {}  # position -> a split array moved to its variable's sharding, to copy
    for position, (array, like) in enumerate(zip(arrays, likes, strict=True)):
        if not isinstance(array, jax.Array):
            copies[position] = np.array(array, copy=True)
        elif array.sharding.is_fully_replicated:
            shards[position] = array.addressable_data(0)
        elif not array.is_fully_addressable:  # split over processes: through the hosts
            from jax.experimental import multihost_utils

            copies[position] = jnp.asarray(multihost_utils.process_allgather(array, tiled=True))
        else:  # split (`state_sharding`, a layout map): where its variable lies, or gathered
            split[position] = jax.device_put(array, _target(array, like))
    # The split arrays are copied together, one program per sharding: a copy each
    # cost a dispatch per variable at every write-back (45 for a small Gemma).
    for position, copy in zip(split, _fresh_copies(list(split.values()))):
        copies[position] = copy
    for position, copy in zip(shards, _fresh_copies(list(shards.values()))):
        like = likes[position]
        if isinstance(like, jax.Array) and like.sharding != copy.sharding:
            copy = jax.device_put(copy, like.sharding)
        copies[position] = copy
    return copies


def _target(array, like):
    """Where a split array is written: its variable's sharding, else whole on its first device."""
    if isinstance(like, jax.Array):
        return like.sharding
    return jax.sharding.SingleDeviceSharding(array.addressable_shards[0].device)
