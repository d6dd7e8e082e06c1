"""Devices and shardings."""

import re

import jax
import keras
import numpy as np
import pytest

import keras_dp
from keras_dp import sharding
from keras_dp import transfer
from conftest import assert_close_to_scale, devices


def test_default_mesh_spans_every_device_on_one_batch_axis():
    mesh = keras_dp.make_mesh()
    assert mesh.axis_names == ("batch",) and sharding.Layout(mesh).batch_shards == 8
    assert mesh.axis_types == (jax.sharding.AxisType.Auto,)


def test_a_users_mesh_is_kept_and_devices_pick_a_sub_mesh():
    mine = keras_dp.make_mesh(devices(2))
    assert keras_dp.make_mesh(mesh=mine) is mine
    assert list(mine.devices.flat) == devices(2)
    with pytest.raises(ValueError, match="either `mesh` or `devices`"):
        keras_dp.make_mesh(devices(2), mine)
    with pytest.raises(ValueError, match="empty"):
        keras_dp.make_mesh([])


def test_place_copies_so_donation_never_deletes_the_source():
    mesh = keras_dp.make_mesh(devices(4))
    source = jax.numpy.arange(6.0)
    copy = transfer.place([source], mesh, sharding.replicated(mesh))[0]
    assert copy.sharding.is_fully_replicated and len(copy.sharding.device_set) == 4
    jax.jit(lambda a: a + 1, donate_argnums=0)(copy)
    assert copy.is_deleted() and not source.is_deleted()
    np.testing.assert_array_equal(
        np.asarray(transfer.place(source, mesh, sharding.replicated(mesh))), np.arange(6.0))


def test_place_copies_a_numpy_source_too():
    # XLA:CPU may alias a numpy buffer even with may_alias=False.
    source = np.arange(6.0)
    mesh = keras_dp.make_mesh(devices(2))
    copy = transfer.place(source, mesh, sharding.replicated(mesh))
    source[:] = -1
    np.testing.assert_array_equal(np.asarray(copy), np.arange(6.0))


def test_local_copy_stays_on_the_device_and_outlives_donation():
    mesh = keras_dp.make_mesh(devices(4))
    state = transfer.place(jax.numpy.arange(6.0), mesh, sharding.replicated(mesh))
    like = jax.device_put(jax.numpy.zeros(6), devices(2)[1])
    with jax.transfer_guard_device_to_host("disallow"):  # no trip through the host
        copy = transfer.local_copy(state, like=like)
    assert copy.sharding == like.sharding
    jax.jit(lambda a: a + 1, donate_argnums=0)(state)
    assert state.is_deleted() and not copy.is_deleted()
    np.testing.assert_array_equal(np.asarray(copy), np.arange(6.0))


def _tiny_sgd_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(4)])
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _tiny_data(rows=48):
    rng = np.random.default_rng(0)
    return rng.normal(size=(rows, 8)).astype("float32"), rng.integers(0, 4, rows)


def _assert_same_training(model, **where):
    """`model` trained by keras_dp on `where` ends where Keras's own fit does."""
    x, y = _tiny_data()
    reference = _tiny_sgd_model()
    reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    keras_dp.fit_sharded(model, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                         **where)
    for ours, theirs in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6 * np.abs(theirs).max())


def test_jax_make_mesh_with_its_default_explicit_axis_trains_on_the_same_devices():
    # jax.make_mesh gives Explicit axes by default; Keras's layers need Auto.
    mine = jax.make_mesh((4,), ("batch",), devices=devices(4)[::-1])
    assert mine.axis_types == (jax.sharding.AxisType.Explicit,)
    mesh = keras_dp.make_mesh(mesh=mine)
    assert mesh.axis_types == (jax.sharding.AxisType.Auto,)
    assert list(mesh.devices.flat) == devices(4)[::-1]
    _assert_same_training(_tiny_sgd_model(), mesh=mine)


def test_a_keras_device_mesh_is_taken_as_its_jax_mesh():
    mesh = keras_dp.make_mesh(mesh=keras.distribution.DeviceMesh((2,), ["batch"], devices(2)))
    assert list(mesh.devices.flat) == devices(2) and mesh.axis_names == ("batch",)
    _assert_same_training(
        _tiny_sgd_model(), mesh=keras.distribution.DeviceMesh((2,), ["batch"], devices(2)))
    data = keras_dp.make_mesh(mesh=keras.distribution.DeviceMesh((2,), ["data"], devices(2)))
    assert list(data.devices.flat) == devices(2) and data.axis_names == ("batch",)
    with pytest.raises(ValueError, match="Mesh or a keras.distribution.DeviceMesh.*list"):
        keras_dp.make_mesh(mesh=devices(2))


@pytest.mark.parametrize("bad", [2, [0, 1], "cpu"])
def test_devices_that_are_not_jax_devices_are_refused_naming_the_fix(bad):
    with pytest.raises(ValueError, match=r"list of JAX devices.*Received: devices="
                                         + re.escape(repr(bad)) + r"\..*jax.devices\(\)\[:2\]"):
        keras_dp.make_mesh(bad)


def test_a_device_listed_twice_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"appear once.*cpu:0\b.*jax.devices\(\)\[:n\]") as err:
        keras_dp.ShardedTrainer(_tiny_sgd_model(), devices=[devices(2)[0]] * 2 + devices(2)[1:])
    assert "cpu:1" not in str(err.value).split("Received:")[1].split("more than")[0]


def test_devices_under_a_model_parallel_scope_are_refused_naming_the_scope():
    # The distribution's mesh decides where a model split over it trains:
    # devices given too are refused (without them, keras_dp trains under it:
    # tests/test_model_axis.py).
    layout = keras.distribution.LayoutMap(keras.distribution.DeviceMesh((2, 2), ["batch", "model"],
                                                                        devices(4)))
    layout[".*dense.*kernel"] = (None, "model")
    distribution = keras.distribution.ModelParallel(layout_map=layout, batch_dim_name="batch")
    with distribution.scope():
        model = _tiny_sgd_model()
        with pytest.raises(ValueError, match=r"ModelParallel.*`with distribution.scope\(\):`.*"
                                             r"`devices` was given.*Drop `devices`.*"
                                             r"set_distribution\(None\).*state_sharding='full'"):
            keras_dp.ShardedTrainer(model, devices=devices(4))
    # Created under the scope, trained outside it: whole copies on keras_dp's
    # mesh, the same steps as Keras's fit, and the variables keep their layout;
    # a LayoutWarning says so.
    kernel = model.layers[0].kernel.value.sharding
    assert kernel.spec == jax.sharding.PartitionSpec(None, "model")
    with pytest.warns(keras_dp.LayoutWarning, match=r"2 of the model's variables were created "
                                                    r"split.*distribution=\.\.\."):
        _assert_same_training(model, devices=devices(4))
    assert model.layers[0].kernel.value.sharding == kernel
    x, _ = _tiny_data()
    assert_close_to_scale(model.predict(x, verbose=0), model(x))


def test_a_keras_distribution_set_after_the_trainer_was_made_is_refused_too():
    # The check ran only when a trainer was made: a ModelParallel set after
    # it went unnoticed, the build created the variables in its layout and
    # its constraints were traced into keras_dp's step. Now fit, evaluate,
    # predict, build and a step by hand refuse it, before building anything.
    def unbuilt_model():  # unseeded: set_random_seed would first import TensorFlow (seconds)
        model = keras.Sequential([keras.layers.Dense(16), keras.layers.Dense(4)])
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy())
        return model

    x, y = _tiny_data(8)
    unbuilt = unbuilt_model()
    trainer = keras_dp.ShardedTrainer(unbuilt, devices=devices(2))
    built = keras_dp.ShardedTrainer(unbuilt_model(), devices=devices(2))
    built.build((x, y))
    state, batch = built.init_state(), built.shard((x, y))
    ensemble = keras_dp.EnsembleTrainer(unbuilt_model, members=2, devices=devices(2))
    members = keras_dp.EnsembleTrainer(unbuilt_model, members=2, devices=devices(2))
    members.build((x, y))
    stacked, replicated = members.init_state(), members.replicate((x, y))
    layout = keras.distribution.LayoutMap(keras.distribution.DeviceMesh((2, 2), ["batch", "model"],
                                                                        devices(4)))
    distribution = keras.distribution.ModelParallel(layout_map=layout, batch_dim_name="batch")
    refused = (r"A ModelParallel distribution is active.*this trainer was made with no Keras "
               r"distribution.*pass it as distribution=.*set_distribution\(None\)")
    ensembles = r"Ensembles train with data parallelism only.*ModelParallel.*set_distribution\(None\)"
    keras.distribution.set_distribution(distribution)
    try:
        for run, message in (
                (lambda: trainer.fit(x, y, batch_size=4, verbose=0), refused),
                (lambda: trainer.evaluate(x, y, verbose=0), refused),
                (lambda: trainer.predict(x, verbose=0), refused),
                (lambda: built.train_step(state, batch), refused),
                (lambda: built.compiled_train_step(state, batch), refused),
                (lambda: ensemble.build((x, y)), ensembles),
                (lambda: members.train_step(stacked, replicated), ensembles),
                (lambda: members.compiled_train_step(stacked, replicated), ensembles)):
            with pytest.raises(ValueError, match=message):
                run()
    finally:
        keras.distribution.set_distribution(None)
    assert not unbuilt.built and not ensemble.members[0].optimizer.built
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves((state, stacked)))  # refused


@pytest.mark.parametrize("name", ["data", "batch"])
def test_a_1d_mesh_of_any_axis_name_is_the_batch_axis_and_2d_is_refused(name):
    # A 1-D mesh whose axis was not named "batch" (("data",), as in JAX's and
    # Flax's examples) was refused; its one axis can only split the batch.
    mine = jax.make_mesh((4,), (name,), devices=devices(4)[::-1])
    trainer = keras_dp.ShardedTrainer(_tiny_sgd_model(), mesh=mine)
    assert trainer.mesh.axis_names == ("batch",) and trainer.num_devices == 4
    assert trainer.mesh.axis_types == (jax.sharding.AxisType.Auto,)
    assert list(trainer.mesh.devices.flat) == devices(4)[::-1]
    two_d = jax.make_mesh((2, 2), (name, "model"), devices=devices(4))
    with pytest.raises(ValueError, match=r"needs a 1-D mesh.*Received: mesh.axis_names=\("
                                         + f"'{name}', 'model'" + r"\).*jax.make_mesh\(\(n,\), "
                                         r"\('batch',\)\).*devices=list\(mesh.devices.flat\)"):
        keras_dp.ShardedTrainer(_tiny_sgd_model(), mesh=two_d)
