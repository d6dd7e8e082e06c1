"""The compiled steps (`keras_dp.core.steps`): pure, donated, one all-reduce, K steps equal to K single ones."""

import jax
import numpy as np
import pytest

import keras_dp
from conftest import assert_close_to_scale, batches_of, devices, mlp, weights


def test_gradients_are_averaged_by_one_all_reduce_in_the_compiled_step(mnist):
    # A model without BatchNorm: its step needs one sum over the devices
    # (gradients, loss and metric totals in one tuple all-reduce), and XLA
    # combines them into exactly one; on one device there is none.
    batch = batches_of(mnist, 1)[0]
    for n_devices, expect in ((4, 1), (1, 0)):
        trainer = keras_dp.ShardedTrainer(mlp(), devices=devices(n_devices))
        trainer.build(batch)
        state = trainer.init_state()
        hlo = trainer.compiled_train_step(state, trainer.shard(batch)).as_text()
        ops = [line for line in hlo.splitlines() if " all-reduce(" in line or " all-reduce-start(" in line]
        assert len(ops) == expect, ops


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
        assert_close_to_scale(b, a)


def test_the_train_step_is_pure_and_donates_its_state(mnist):
    trainer = keras_dp.ShardedTrainer(mlp(), devices=devices(2))
    batch = batches_of(mnist, 1, size=33)[0]
    trainer.build(batch)
    device_batch = trainer.shard(batch)
    first, second = trainer.init_state(), trainer.init_state()
    state_a, logs_a = trainer.train_step(first, device_batch)
    state_b, logs_b = trainer.train_step(second, device_batch)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(first))
    assert float(logs_a["loss"]) == float(logs_b["loss"])
    for a, b in zip(jax.tree.leaves(state_a), jax.tree.leaves(state_b)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_test_step_reads_weights_and_updates_only_metrics(mnist):
    trainer = keras_dp.ShardedTrainer(mlp(), devices=devices(2))
    batch = batches_of(mnist, 1, size=33)[0]
    trainer.build(batch)
    state = trainer.init_state()
    before = [np.asarray(w) for w in state.trainable]
    _, metrics, logs = trainer.programs.test_step(state.weights, state.metrics, trainer.shard(batch))
    after = [np.asarray(w) for w in state.trainable]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    reference = keras_dp.ShardedTrainer(mlp(), devices=devices(1)).evaluate(*batch, verbose=0)
    np.testing.assert_allclose(float(logs["loss"]), reference[0], rtol=1e-5)
