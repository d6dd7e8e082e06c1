"""Never hang on XLA:CPU: back-to-back runs with 8 simulated devices.

Dispatching steps with a cross-device all-reduce without waiting aborted
about half of such runs on a 2-core machine; keras_dp keeps one step in
flight on CPU. Each test also runs under pytest-timeout.
"""

import pytest

import keras_dp
from conftest import convnet, devices


def run_many(mnist, runs):
    (x, y), _ = mnist
    finals = []
    for run in range(runs):
        history = keras_dp.fit_sharded(
            convnet(seed=run), x[:1024], y[:1024], batch_size=64, verbose=0,
            devices=devices(8),
        )
        finals.append(history.history["loss"][-1])
    return finals


@pytest.mark.slow  # 8.5 s; every 8-device fit of the suite runs under the same bound in CI
def test_three_back_to_back_runs_on_8_devices(mnist):
    losses = run_many(mnist, 3)
    assert len(losses) == 3 and all(0 < loss < 2.3 for loss in losses)


@pytest.mark.slow
def test_twenty_back_to_back_runs_on_8_devices(mnist):
    losses = run_many(mnist, 20)
    assert len(losses) == 20 and all(0 < loss < 2.3 for loss in losses)
