"""What Keras's own trainer tests ask of `model.fit`, in short, against Keras on one device.

The whole of Keras's tests runs through keras_dp in the slow
tests/test_keras_conformance.py; these are the cases it found, each fast:
a layer with Keras's JAX trainer mixed in, sparse batches from a generator,
a `compute_loss` written before it took `training`, and Keras's debugging
limits on epochs and steps. Each runs on 2 simulated devices and compares
the weights (within 1e-5 of each variable's largest entry) with Keras's.
"""

import warnings

import keras
import numpy as np
import pytest
from keras.src.backend.jax.trainer import JAXTrainer

import keras_dp
from conftest import assert_close_to_scale, assert_weights_close, devices


class DenseModel(JAXTrainer, keras.layers.Dense):
    """Keras's trainer_test.py `ExampleModel`: a Dense layer that is a model, not a keras.Model."""

    def __init__(self, units=3):
        keras.layers.Dense.__init__(self, units=units, use_bias=False,
                                    kernel_initializer=keras.initializers.Ones())
        JAXTrainer.__init__(self)


def compiled(model, **options):
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", metrics=["mae"], **options)
    return model


def data(rows=40, seed=0):
    rng = np.random.default_rng(seed)
    return rng.random((rows, 4), "float32"), rng.random((rows, 3), "float32")


def test_a_layer_with_keras_jax_trainer_mixed_in_trains_evaluates_and_predicts_as_keras():
    x, y = data()
    ours, theirs = compiled(DenseModel()), compiled(DenseModel())
    options = dict(batch_size=8, epochs=2, shuffle=False, verbose=0, validation_data=(x, y))
    history = keras_dp.fit_sharded(ours, x, y, devices=devices(2), **options)
    keras_history = theirs.fit(x, y, **options)
    assert not isinstance(ours, keras.Model)
    for name, values in keras_history.history.items():
        np.testing.assert_allclose(history.history[name], values, rtol=1e-5, err_msg=name)
    assert_weights_close(ours, theirs)
    assert int(ours.optimizer.iterations) == int(theirs.optimizer.iterations) == 10
    trainer = keras_dp.ShardedTrainer(ours, devices=devices(2))
    np.testing.assert_allclose(trainer.evaluate(x, y, batch_size=8, verbose=0),
                               theirs.evaluate(x, y, batch_size=8, verbose=0), rtol=1e-5)
    assert_close_to_scale(trainer.predict(x, batch_size=8, verbose=0),
                          theirs.predict(x, batch_size=8, verbose=0))


def test_a_layer_without_the_trainer_is_still_refused_naming_the_fix():
    with pytest.raises(TypeError, match=r"keras_dp trains a keras.Model \(or a Keras layer "
                       r"with Keras's JAX trainer mixed in.*Wrap layers in keras.Sequential"):
        keras_dp.ShardedTrainer(keras.layers.Dense(3))


def sparse_batches(kind):
    """4 batches of 2 rows of 4 features, a quarter of them nonzero, as `kind` sparse arrays."""
    rng = np.random.default_rng(0)
    for _ in range(4):
        dense = (rng.random((2, 4)) * (rng.random((2, 4)) < 0.25)).astype("float32")
        y = rng.random((2, 3), "float32")
        if kind == "scipy":
            import scipy.sparse

            yield scipy.sparse.csr_matrix(dense), y
        elif kind == "tf":
            import tensorflow as tf

            yield tf.sparse.from_dense(dense), y
        elif kind == "jax":
            from jax.experimental import sparse

            yield sparse.BCOO.fromdense(dense), y
        else:
            yield dense, y


@pytest.mark.parametrize("kind", ["scipy", "tf", "jax"])
def test_sparse_batches_from_a_generator_train_and_predict_as_their_dense_matrices(kind):
    # Keras's fit on JAX hands them to the model as JAX sparse arrays; keras_dp
    # densifies each batch on the host, as it does sparse arrays given whole.
    ours, dense, theirs = (compiled(DenseModel()) for _ in range(3))
    keras_dp.fit_sharded(ours, sparse_batches(kind), verbose=0, devices=devices(2))
    keras_dp.fit_sharded(dense, sparse_batches("dense"), verbose=0, devices=devices(2))
    theirs.fit(sparse_batches(kind), verbose=0)
    for mine, other in zip(ours.get_weights(), dense.get_weights(), strict=True):
        np.testing.assert_array_equal(mine, other)
    assert_weights_close(ours, theirs)
    assert int(ours.optimizer.iterations) == 4
    predicted = keras_dp.ShardedTrainer(ours, devices=devices(2)).predict(
        sparse_batches(kind), verbose=0)
    assert_close_to_scale(predicted, theirs.predict(sparse_batches(kind), verbose=0))
    assert predicted.shape == (8, 3)


class NoTrainingArgument(keras.Model):
    """A `compute_loss` override as written before Keras 3.3 gave it `training`."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(3)

    def call(self, x):
        return self.dense(x)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None):
        return keras.ops.mean((y - y_pred) ** 2) * 2.0


def test_a_compute_loss_without_a_training_argument_is_called_as_keras_calls_it():
    x, y = data()

    def model():
        keras.utils.set_random_seed(0)
        built = NoTrainingArgument()
        built.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        return built

    ours, theirs = model(), model()
    history = keras_dp.fit_sharded(ours, x, y, batch_size=8, epochs=2, shuffle=False,
                                   verbose=0, devices=devices(2))
    keras_history = theirs.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["loss"], keras_history.history["loss"],
                               rtol=1e-5)
    assert_weights_close(ours, theirs)


@pytest.fixture
def keras_limits():
    keras.config.set_max_epochs(2)
    keras.config.set_max_steps_per_epoch(3)
    yield
    keras.config.set_max_epochs(None)
    keras.config.set_max_steps_per_epoch(None)


def test_keras_debugging_limits_cap_epochs_and_every_loops_steps(keras_limits):
    # keras.config.set_max_epochs(2) and set_max_steps_per_epoch(3): 10
    # batches a pass, 4 epochs asked; Keras runs 2 epochs of 3 steps, its
    # validation, evaluate and predict 3 batches each.
    x, y = data(80)
    ours, theirs = compiled(DenseModel()), compiled(DenseModel())
    options = dict(batch_size=8, epochs=4, shuffle=False, verbose=0, validation_data=(x, y))
    with pytest.warns(UserWarning, match="Limiting epochs to 2"):
        history = keras_dp.fit_sharded(ours, x, y, devices=devices(2), **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        keras_history = theirs.fit(x, y, **options)
    assert history.epoch == keras_history.epoch == [0, 1]
    assert int(ours.optimizer.iterations) == int(theirs.optimizer.iterations) == 6
    for name, values in keras_history.history.items():
        np.testing.assert_allclose(history.history[name], values, rtol=1e-5, err_msg=name)
    assert_weights_close(ours, theirs)
    trainer = keras_dp.ShardedTrainer(ours, devices=devices(2))
    with pytest.warns(UserWarning, match="Limiting steps_per_epoch to 3"):
        predicted = trainer.predict(x, batch_size=8, verbose=0)
    assert predicted.shape == theirs.predict(x, batch_size=8, verbose=0).shape == (24, 3)
    np.testing.assert_allclose(trainer.evaluate(x, y, batch_size=8, verbose=0),
                               theirs.evaluate(x, y, batch_size=8, verbose=0), rtol=1e-5)


class CountsResets(keras.Sequential):
    """Counts `reset_metrics` calls, as a model that logs or resets more in it would see them."""

    resets = 0

    def reset_metrics(self):
        self.resets += 1
        super().reset_metrics()


def test_reset_metrics_is_called_as_often_as_under_keras():
    # Keras calls it at each epoch's start and at each evaluation's: 3 epochs
    # with validation, 6; keras_dp called it 8 times (twice at an epoch's start).
    x, y = data()

    def model():
        built = CountsResets([keras.Input((4,)), keras.layers.Dense(3)])
        return compiled(built)

    ours, theirs = model(), model()
    options = dict(batch_size=8, epochs=3, verbose=0, validation_data=(x, y))
    keras_dp.fit_sharded(ours, x, y, devices=devices(2), **options)
    theirs.fit(x, y, **options)
    assert ours.resets == theirs.resets == 6
    keras_dp.ShardedTrainer(ours, devices=devices(2)).evaluate(x, y, verbose=0)
    theirs.evaluate(x, y, verbose=0)
    assert ours.resets == theirs.resets == 7
