"""steps_per_execution: K optimizer steps in one compiled call, exactly."""

import numpy as np
import pytest

import keras_dp
from conftest import BatchEnds, devices, mlp, weights


def test_k_steps_per_call_equal_k_single_steps(mnist):
    # 700 rows at batch 64 on 3 devices: 10 full batches (two calls of 4,
    # then 2 single steps) and a 60-row batch, run alone.
    (x, y), _ = mnist
    results = {}
    for k in (1, 4):
        model = mlp(seed=2, dropout=0.5)
        trainer = keras_dp.ShardedTrainer(model, devices=devices(3), steps_per_execution=k)
        history = trainer.fit(x[:700], y[:700], batch_size=64, epochs=2, verbose=0)
        results[k] = (history.history, weights(model), int(model.optimizer.iterations.numpy()))
    assert results[4][2] == results[1][2] == 22
    assert results[4][0] == results[1][0]  # the same losses and accuracies, bitwise
    for a, b in zip(results[1][1], results[4][1]):
        np.testing.assert_array_equal(a, b)


def test_the_multi_step_program_compiles_once_and_callbacks_see_each_call(mnist):
    (x, y), _ = mnist
    record = BatchEnds()
    trainer = keras_dp.ShardedTrainer(mlp(), devices=devices(2), steps_per_execution=4)
    trainer.fit(x[:600], y[:600], batch_size=64, epochs=2, verbose=0, callbacks=[record])
    # 9 full batches and one of 24 rows: calls of 4, 4, then 1 and 1 alone.
    assert record.ends == [3, 7, 8, 9] * 2
    assert trainer._train_steps._cache_size() == 1
    assert trainer._train_step._cache_size() == 2  # 64 rows and 24 rows


def test_steps_per_execution_comes_from_compile_and_scan_unrolls_on_cpu():
    model = mlp()
    model.compile(optimizer="adam", loss=model.loss, steps_per_execution=8)
    trainer = keras_dp.ShardedTrainer(model, devices=devices(2))
    assert trainer.steps_per_execution == 8
    with pytest.raises(ValueError, match="`steps_per_execution` must be at least 1"):
        keras_dp.ShardedTrainer(mlp(), steps_per_execution=0)


@pytest.mark.parametrize("unroll", [1, 4])
def test_a_rolled_scan_gives_the_same_steps(mnist, unroll):
    (x, y), _ = mnist
    reference, model = mlp(seed=4), mlp(seed=4)
    keras_dp.fit_sharded(reference, x[:256], y[:256], batch_size=64, shuffle=False, verbose=0,
                         devices=devices(2))
    trainer = keras_dp.ShardedTrainer(model, devices=devices(2), steps_per_execution=4,
                                      unroll=unroll)
    trainer.fit(x[:256], y[:256], batch_size=64, shuffle=False, verbose=0)
    for a, b in zip(weights(reference), weights(model)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_prefetch_keeps_order_raises_in_place_and_stops_when_closed():
    import threading
    import time

    from keras_dp.data import prefetch

    assert list(prefetch(iter(range(50)), 2)) == list(range(50))
    assert list(prefetch(iter(range(5)), 0)) == list(range(5))

    def failing():
        yield 1
        raise ValueError("batch 1 is bad")

    seen = []
    with pytest.raises(ValueError, match="batch 1 is bad"):
        for item in prefetch(failing(), 2):
            seen.append(item)
    assert seen == [1]
    produced = []
    stream = prefetch((produced.append(i) or i for i in range(1000)), 2)
    assert next(stream) == 0
    stream.close()
    time.sleep(0.5)
    assert len(produced) <= 4  # the one taken, two queued, one waiting
    assert not any(t.name == "keras_dp-prefetch" for t in threading.enumerate())
