"""steps_per_execution: K optimizer steps in one compiled call, exactly."""

import pytest

import keras_dp
from conftest import BatchEnds, devices, mlp


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
