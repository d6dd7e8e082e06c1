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
