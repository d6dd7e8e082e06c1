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
