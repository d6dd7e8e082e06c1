"""The bound on steps in flight (`keras_dp.inflight`) and its check of each finished step."""


import numpy as np

import keras_dp
from conftest import convnet, devices


def test_one_step_in_flight_on_cpu():
    assert keras_dp.ShardedTrainer(convnet(), devices=devices(8)).steps_in_flight == 1


def test_the_throttle_keeps_at_most_limit_calls_and_finds_the_first_bad_step():
    from keras_dp import inflight

    throttle = inflight.Throttle(2)
    for index in range(3):
        throttle.add((index, 0, {"loss": np.float32(1.0)}))
        assert len(throttle._pending) < 2
    throttle.add((3, 2, {"loss": np.float32(np.nan)}))  # a call of steps 3.. whose 2 first were fine
    throttle.add((8, 0, {"loss": np.float32(np.inf)}))
    throttle.drain()
    assert throttle.failure[0] == 5 and np.isnan(throttle.failure[1])
    message = inflight.failure_message(1, *throttle.failure)
    assert "epoch 2, batch 5" in message and "TerminateOnNaN" in message
