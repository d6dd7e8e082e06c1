"""The bound on steps in flight (`keras_dp.core.live`) and its check of each finished step."""


import numpy as np

import keras_dp
from conftest import convnet, devices


def test_one_step_in_flight_on_cpu():
    assert keras_dp.ShardedTrainer(convnet(), devices=devices(8)).steps_in_flight == 1


def test_the_throttle_keeps_at_most_limit_calls_and_finds_the_first_bad_step():
    from keras_dp.core import live as inflight

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


def test_the_last_good_state_is_the_newest_that_completed_before_a_failure():
    import jax

    from keras_dp.core import live as inflight

    def needs_16_tib(x):  # compiles; XLA fails to allocate its memory when it runs
        huge = x[0] - jax.lax.iota("float32", 2**42)
        return x + jax.lax.slice(jax.lax.sort(huge), (0,), (1,))

    good = [jax.numpy.ones(3)]
    failed = jax.jit(needs_16_tib)(good[0])  # returns at once; the error comes when awaited
    last_good = inflight.LastGood()
    last_good.reset(good, (0, 0))
    last_good.dispatched([good[0] + 1], (0, 1))
    last_good.dispatched([failed], (0, 2))
    last_good.dispatched([failed * 2], (0, 3))  # computed from the failed state
    state, position = last_good.confirm(wait=True)
    assert position == (0, 1) and float(state[0][0]) == 2.0
    assert last_good.confirm() == (state, (0, 1))  # the failed and later ones are dropped
    last_good.stop()  # a call donated its input: nothing is kept any more
    last_good.dispatched([good[0] + 3], (0, 4))
    assert last_good.confirm(wait=True) == (None, None)
