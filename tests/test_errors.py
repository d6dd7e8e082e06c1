"""Bad input fails at once, with a message that names the problem and the fix."""

import keras
import numpy as np
import pytest

import keras_dp
from conftest import BatchEnds, devices, mlp


def test_a_non_keras_object_is_refused():
    with pytest.raises(TypeError, match="keras_dp trains a keras.Model.*Received an object of type"):
        keras_dp.fit_sharded(object(), np.zeros((8, 28, 28, 1)), np.zeros(8))
    with pytest.raises(TypeError, match="Wrap layers in keras.Sequential"):
        keras_dp.ShardedTrainer(keras.layers.Dense(3))


def test_labels_that_do_not_fit_the_output_are_refused_before_compiling(mnist):
    (x, y), _ = mnist
    one_hot = np.eye(10, dtype=np.float32)[y[:64]]
    with pytest.raises(ValueError, match=r"labels do not fit.*y has shape \(64, 10\).*sparse_categorical"):
        keras_dp.fit_sharded(mlp(), x[:64], one_hot, batch_size=64, verbose=0, devices=devices(2))
    with pytest.raises(ValueError, match="labels do not fit") as error:
        keras_dp.fit_sharded(mlp(), x[:64], np.zeros((64, 3)), batch_size=64, verbose=0)
    # keras_dp's own message, without Keras's chained traceback or a repr.
    assert error.value.__cause__ is None and error.value.__suppress_context__
    assert "the loss is sparse_categorical_crossentropy. Give labels" in str(error.value)
    assert str(error.value).endswith(
        "Keras reported: Arguments `target` and `output` must have the same shape up "
        "until the last dimension: target.shape=(64, 3), output.shape=(64, 10)")


def test_an_uncompiled_model_without_optimizer_and_loss_is_refused():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    trainer = keras_dp.ShardedTrainer(model)  # enough to predict
    x = np.ones((5, 4), "float32")
    with pytest.raises(ValueError, match="not compiled.*model.compile"):
        trainer.fit(x, np.ones((5, 2)), verbose=0)
    with pytest.raises(ValueError, match="not compiled.*model.compile"):
        keras_dp.fit_sharded(model, x, np.ones((5, 2)), verbose=0)


def test_an_unbuildable_model_is_refused_with_the_fix(mnist):
    (x, y), _ = mnist
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(10)])
    keras_dp.models.compile_classifier(model)
    with pytest.raises(ValueError, match="could not be built.*x matches"):
        keras_dp.fit_sharded(model, x[:64], y[:64], batch_size=64, verbose=0)


def test_init_state_of_an_unbuilt_model_names_the_fix():
    model = keras_dp.models.compile_classifier(keras.Sequential([keras.layers.Dense(10)]))
    with pytest.raises(ValueError, match=r"not built.*trainer.build\(batch\)"):
        keras_dp.ShardedTrainer(model).init_state()


def test_a_mesh_without_the_batch_axis_is_refused():
    import jax
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    with pytest.raises(ValueError, match="single axis 'batch'.*keras_dp.make_mesh"):
        keras_dp.ShardedTrainer(mlp(), mesh=mesh)


def test_bad_validation_labels_fail_before_the_first_step(mnist):
    (x, y), _ = mnist
    record = BatchEnds()
    with pytest.raises(ValueError, match="labels do not fit"):
        keras_dp.fit_sharded(mlp(), x[:128], y[:128], batch_size=64, verbose=0,
                             validation_data=(x[:64], np.zeros((64, 3))),
                             callbacks=[record], devices=devices(2))
    assert record.ends == []


def test_a_model_parallel_keras_distribution_is_refused_not_ignored():
    layout = keras.distribution.LayoutMap(keras.distribution.DeviceMesh((2,), ["model"],
                                                                        devices(2)))
    layout["dense.*kernel"] = (None, "model")
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout, batch_dim_name=None))
    try:
        with pytest.raises(ValueError, match="data parallelism only.*ModelParallel.*"
                                             r"set_distribution\(None\)"):
            keras_dp.ShardedTrainer(mlp(), devices=devices(2))
        with pytest.raises(ValueError, match="ModelParallel"):
            keras_dp.fit_ensemble(mlp, np.zeros((8, 28, 28, 1)), np.zeros(8), verbose=0,
                                  devices=devices(2))
        keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices(2)))
        keras_dp.ShardedTrainer(mlp(), devices=devices(2))  # the same layout: accepted
    finally:
        keras.distribution.set_distribution(None)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_steps_in_flight_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="steps_in_flight.*at least 1.*Received: steps_in_flight="):
        keras_dp.ShardedTrainer(mlp(), steps_in_flight=bad)


def test_checkpoints_with_steps_per_epoch_are_refused_before_training(mnist, tmp_path):
    (x, y), _ = mnist
    model = mlp()
    with pytest.raises(ValueError, match="checkpoint_dir cannot be combined with steps_per_epoch"):
        keras_dp.fit_sharded(model, x[:64], y[:64], steps_per_epoch=2, verbose=0,
                             checkpoint_dir=tmp_path / "ckpt", devices=devices(2))
    assert int(model.optimizer.iterations.value) == 0


def test_labels_missing_for_a_compiled_loss_are_named(mnist):
    (x, _), _ = mnist
    with pytest.raises(ValueError, match="compiled with a loss.*no labels"):
        keras_dp.fit_sharded(mlp(), x[:64], verbose=0, devices=devices(2))


def test_a_recompiled_optimizer_is_built_again_by_the_build_cache(mnist):
    (x, y), _ = mnist
    model = mlp()
    trainer = keras_dp.ShardedTrainer(model, devices=devices(2))
    trainer.build((x[:8], y[:8]))
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=model.loss)
    assert not model.optimizer.built
    trainer.build((x[:8], y[:8]))  # same data: the cache must see a new optimizer
    assert model.optimizer.built
