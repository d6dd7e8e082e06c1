"""Devices and shardings."""

import jax
import numpy as np
import pytest

import keras_dp
from keras_dp import mesh as mesh_lib
from conftest import devices


def test_default_mesh_spans_every_device_on_one_batch_axis():
    mesh = keras_dp.make_mesh()
    assert mesh.axis_names == ("batch",) and mesh_lib.num_devices(mesh) == 8
    assert mesh.axis_types == (jax.sharding.AxisType.Auto,)


def test_a_users_mesh_is_kept_and_devices_pick_a_sub_mesh():
    mine = keras_dp.make_mesh(devices(2))
    assert keras_dp.make_mesh(mesh=mine) is mine
    assert list(mine.devices.flat) == devices(2)
    with pytest.raises(ValueError, match="either `mesh` or `devices`"):
        keras_dp.make_mesh(devices(2), mine)
    with pytest.raises(ValueError, match="empty"):
        keras_dp.make_mesh([])


def test_replicate_copies_so_donation_never_deletes_the_source():
    mesh = keras_dp.make_mesh(devices(4))
    source = jax.numpy.arange(6.0)
    copy = mesh_lib.replicate([source], mesh)[0]
    assert copy.sharding.is_fully_replicated and len(copy.sharding.device_set) == 4
    jax.jit(lambda a: a + 1, donate_argnums=0)(copy)
    assert copy.is_deleted() and not source.is_deleted()
    np.testing.assert_array_equal(mesh_lib.to_host(mesh_lib.replicate(source, mesh)), np.arange(6.0))


def test_replicate_copies_a_numpy_source_too():
    # XLA:CPU may alias a numpy buffer even with may_alias=False.
    source = np.arange(6.0)
    copy = mesh_lib.replicate(source, keras_dp.make_mesh(devices(2)))
    source[:] = -1
    np.testing.assert_array_equal(mesh_lib.to_host(copy), np.arange(6.0))


def test_local_copy_stays_on_the_device_and_outlives_donation():
    mesh = keras_dp.make_mesh(devices(4))
    state = mesh_lib.replicate(jax.numpy.arange(6.0), mesh)
    like = jax.device_put(jax.numpy.zeros(6), devices(2)[1])
    with jax.transfer_guard_device_to_host("disallow"):  # no trip through the host
        copy = mesh_lib.local_copy(state, like=like)
    assert copy.sharding == like.sharding
    jax.jit(lambda a: a + 1, donate_argnums=0)(state)
    assert state.is_deleted() and not copy.is_deleted()
    np.testing.assert_array_equal(np.asarray(copy), np.arange(6.0))


def test_every_batch_is_sharded_padded_to_split_evenly():
    mesh = keras_dp.make_mesh(devices(4))
    even = keras_dp.data.to_device((np.zeros((8, 2)), np.zeros(8), None), mesh)
    assert even.rows == 8
    assert [s.data.shape for s in even.data[0].addressable_shards] == [(2, 2)] * 4
    # 6 rows on 4 devices: padded to 8 with copies of the last row.
    x = np.arange(12.0).reshape(6, 2)
    uneven = keras_dp.data.to_device((x, np.arange(6), None), mesh)
    assert uneven.rows == 6 and uneven.data[2] is None
    assert [s.data.shape for s in uneven.data[0].addressable_shards] == [(2, 2)] * 4
    np.testing.assert_array_equal(np.asarray(uneven.data[0]), np.concatenate([x, x[[5, 5]]]))
    np.testing.assert_array_equal(np.asarray(uneven.data[1]), [0, 1, 2, 3, 4, 5, 5, 5])
