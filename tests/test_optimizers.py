"""Optimizer features that act on the whole gradient or across steps equal Keras's `model.fit`.

3 devices, 50 rows in batches of 16 (16 does not divide by 3, the last batch
has 2 rows), against Keras's `model.fit` on one device from the same
initial weights: every weight and optimizer variable (slots, accumulators,
EMA copies, the iteration count) within 1e-5 of its own scale. About 5 s of
CPU a case, so all but `global_clipnorm` run with `--runslow`.
"""

import keras
import numpy as np
import pytest

import keras_dp
from conftest import assert_close_to_scale
from conftest import devices

schedules = keras.optimizers.schedules


def _model(optimizer):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(3)])
    model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


@pytest.mark.parametrize("make_optimizer,steps_per_execution,updates", [
    # Clips the global norm of the all-reduced gradient, not each device's.
    (lambda: keras.optimizers.SGD(0.1, global_clipnorm=0.05), 1, 8),
    # The accumulators are optimizer variables, carried across K-step programs
    # and across epochs (4 steps per epoch, an update every 3: 2 in 8 steps).
    pytest.param(lambda: keras.optimizers.Adam(1e-2, gradient_accumulation_steps=3), 2, 2,
                 marks=pytest.mark.slow),
    pytest.param(lambda: keras.optimizers.Adam(1e-2, use_ema=True, ema_overwrite_frequency=3),
                 2, 8, marks=pytest.mark.slow),
    pytest.param(lambda: keras.optimizers.SGD(
        schedules.PiecewiseConstantDecay([2, 5], [0.1, 0.05, 0.01])), 2, 8, marks=pytest.mark.slow),
], ids=["global_clipnorm", "accumulation", "ema", "schedule"])
def test_optimizer_state_equals_keras_fit(make_optimizer, steps_per_execution, updates):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(50, 6)).astype("float32"), rng.integers(0, 3, size=50)
    options = dict(batch_size=16, epochs=2, shuffle=False, verbose=0)
    reference = _model(make_optimizer())
    expected = reference.fit(x, y, **options).history
    model = _model(make_optimizer())
    history = keras_dp.fit_sharded(model, x, y, devices=devices(3),
                                   steps_per_execution=steps_per_execution, **options).history
    for key in expected:
        np.testing.assert_allclose(history[key], expected[key], rtol=1e-5)
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations) == updates
    ours = model.weights + model.optimizer.variables
    theirs = reference.weights + reference.optimizer.variables
    for a, b in zip(ours, theirs, strict=True):
        a, b = np.asarray(a.value, np.float64), np.asarray(b.value, np.float64)
        assert_close_to_scale(a, b)


def _give_each_its_buffer(model):
    """What keras_dp does after `finalize_variable_values`, done by hand on Keras's model."""
    seen = set()
    for variable in model.weights + model.optimizer.variables:
        if id(variable.value) in seen:
            variable.assign(np.array(variable.value))
        seen.add(id(variable.value))


def test_after_fit_with_ema_keras_and_keras_dp_calls_follow_and_equal_keras():
    """`use_ema`: Keras's `finalize_variable_values`, at the end of fit, assigns each
    moving average to its weight, and the two then hold one buffer. Before,
    keras_dp handed the model back so: Keras's `predict` donated the weights'
    buffers, deleting the averages, and the next `model.fit` or `fit_sharded`
    failed. Keras's own model is left so too (its `fit` after `predict` fails),
    so the reference gets each variable a buffer of its own by hand.
    """
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 6)).astype("float32"), rng.integers(0, 3, size=32)
    options = dict(batch_size=8, shuffle=False, verbose=0)
    make = lambda: _model(keras.optimizers.Adam(1e-2, use_ema=True))  # noqa: E731
    reference, model = make(), make()
    reference.fit(x, y, epochs=2, **options)
    _give_each_its_buffer(reference)
    keras_dp.fit_sharded(model, x, y, epochs=2, devices=devices(2), **options)
    averages = [v for v in model.optimizer.variables if v.path.endswith("_average")]
    for weight, average in zip(model.trainable_variables, averages, strict=True):
        np.testing.assert_array_equal(weight.value, average.value)  # as Keras's fit ends
        assert weight.value is not average.value
    assert_close_to_scale(model.predict(x, verbose=0), reference.predict(x, verbose=0))
    assert_close_to_scale(model.evaluate(x, y, verbose=0), reference.evaluate(x, y, verbose=0))
    model.fit(x, y, epochs=1, **options)
    reference.fit(x, y, epochs=1, **options)
    _give_each_its_buffer(reference)
    keras_dp.fit_sharded(model, x, y, epochs=1, devices=devices(2), **options)
    reference.fit(x, y, epochs=1, **options)
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations) == 16
    ours = model.weights + model.optimizer.variables
    theirs = reference.weights + reference.optimizer.variables
    for a, b in zip(ours, theirs, strict=True):
        assert_close_to_scale(np.asarray(a.value, np.float64), np.asarray(b.value, np.float64),
                              err_msg=a.path)
