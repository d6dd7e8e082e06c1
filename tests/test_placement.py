"""Placement (`keras_dp.sharding`, the hosts): host batches onto the mesh, padded, and cut back inside a step."""

import jax
import keras
import numpy as np
import pytest

import keras_dp
from keras_dp import sharding as placement
from keras_dp.multihost import hosts as hosts_lib
from conftest import assert_close_to_scale, devices, mlp


def test_every_batch_is_sharded_padded_to_split_evenly():
    mesh = keras_dp.make_mesh(devices(4))
    even = placement.to_device((np.zeros((8, 2)), np.zeros(8), None), placement.Layout(mesh))
    assert even.rows == 8
    assert [s.data.shape for s in even.data[0].addressable_shards] == [(2, 2)] * 4
    # 6 rows on 4 devices: padded to 8 with copies of the last row.
    x = np.arange(12.0).reshape(6, 2)
    uneven = placement.to_device((x, np.arange(6), None), placement.Layout(mesh))
    assert uneven.rows == 6 and uneven.data[2] is None
    assert [s.data.shape for s in uneven.data[0].addressable_shards] == [(2, 2)] * 4
    np.testing.assert_array_equal(np.asarray(uneven.data[0]), np.concatenate([x, x[[5, 5]]]))
    np.testing.assert_array_equal(np.asarray(uneven.data[1]), [0, 1, 2, 3, 4, 5, 5, 5])


def test_sharding_a_batch_without_rows_by_hand_is_refused(mnist):
    (x, y), _ = mnist
    trainer = keras_dp.ShardedTrainer(mlp(), devices=devices(2))
    with pytest.raises(ValueError, match="no rows cannot be placed.*past the end"):
        trainer.shard((x[5000:5064], y[5000:5064]))


def test_a_batch_of_blocks_trains_like_its_real_rows_concatenated(mnist):
    # The layout of a multi-process batch, on one process: two blocks of 8
    # rows of which 5 and 3 are real. The step must equal one on those 8 rows.
    (x, y), _ = mnist
    mesh = keras_dp.make_mesh(devices(4))
    rows = np.concatenate([np.arange(5), np.full(3, 4), 8 + np.arange(3), np.full(5, 10)])
    blocked = placement.DeviceBatch(
        jax.device_put((x[rows], y[rows], None), placement.Layout(mesh).batch), 8, (5, 3)
    )
    real = np.concatenate([np.arange(5), 8 + np.arange(3)])
    results = []
    for batch in (blocked, None):
        keras.utils.set_random_seed(0)
        trainer = keras_dp.ShardedTrainer(_mlp(), mesh=mesh)
        trainer.build((x[:8], y[:8]))
        batch = batch or trainer.shard((x[real], y[real]))
        state, logs = trainer.train_step(trainer.init_state(), batch)
        results.append((jax.device_get(state.trainable), jax.device_get(logs)))
    for a, b in zip(*(jax.tree.leaves(result) for result in results)):
        assert_close_to_scale(a, b)
    predictions, _ = keras_dp.core.steps.make_predict_program(trainer.model, placement.Layout(mesh))(
        keras_dp.core.state.model_weights(trainer.model, mesh),
        placement.DeviceBatch(blocked.data[0], 8, (5, 3)),
    )
    predictions = np.asarray(predictions)
    assert not predictions[5:8].any() and not predictions[11:].any()  # padding: zeros
    assert_close_to_scale(predictions[[0, 1, 2, 3, 4, 8, 9, 10]],
                          trainer.model.predict(x[real], verbose=0))


def _mlp():
    model = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Rescaling(1 / 255),
                              keras.layers.Flatten(), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.SGD(0.05),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def test_real_rows_inside_a_step_are_the_host_rows_and_restore_rows_inverts_it():
    mesh = keras_dp.make_mesh(devices(3))
    x = np.arange(14.0).reshape(7, 2)
    batch = placement.to_device((x,), placement.Layout(mesh))
    assert batch.rows == 7 and batch.data[0].shape == (9, 2)
    np.testing.assert_array_equal(np.asarray(batch.data[0])[7:], [x[-1], x[-1]])  # the last row

    @jax.jit
    def cut_and_restore(batch):
        (real,) = placement.real_rows(batch, placement.Layout(mesh))
        return real.sum(), placement.restore_rows(real * 2, batch)

    total, restored = cut_and_restore(batch)
    assert float(total) == x.sum()
    np.testing.assert_array_equal(np.asarray(restored), np.concatenate([x * 2, np.zeros((2, 2))]))


def test_stacked_batches_are_split_by_rows_and_kept_whole_by_step():
    mesh = keras_dp.make_mesh(devices(2))
    stack = placement.to_device_stacked([(np.full((3, 1), k),) for k in range(4)],
                                        placement.Layout(mesh))
    assert stack.rows == 3 and stack.data[0].shape == (4, 4, 1)
    assert stack.data[0].sharding.spec == jax.sharding.PartitionSpec(None, "batch")
    with pytest.raises(ValueError, match="must all have 3 rows"):
        placement.to_device_stacked([(np.zeros((3, 1)),), (np.zeros((2, 1)),)],
                                    placement.Layout(mesh))


def test_one_process_placement_looks_ahead_and_groups_k_steps():
    mesh = keras_dp.make_mesh(devices(2))
    place = hosts_lib.hosts_for(placement.Layout(mesh), prefetch=2)
    assert place.whole_data and place.local_batch_size(64) == 64
    host = [(np.zeros((4, 1)),)] * 3 + [(np.zeros((1, 1)),)]
    steps = list(place.steps(iter(host), 2, host[0]))
    assert [(k, batch.rows) for k, batch in steps] == [(2, 4), (1, 4), (1, 1)]
