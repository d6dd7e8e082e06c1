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


def test_indivisible_batches_are_replicated_divisible_ones_sharded():
    mesh = keras_dp.make_mesh(devices(4))
    sharded = keras_dp.data.to_device((np.zeros((8, 2)), np.zeros(8), None), mesh)
    assert [s.data.shape for s in sharded[0].addressable_shards] == [(2, 2)] * 4
    replicated = keras_dp.data.to_device((np.zeros((6, 2)), np.zeros(6), None), mesh)
    assert replicated[0].sharding.is_fully_replicated and replicated[2] is None
