"""`keep_last_good`: what it costs, when "auto" chooses it, and the programs it picks.

The faults it guards against are made real in tests/test_faults.py.
"""

import gc

import jax
import keras
import numpy as np
import pytest

import keras_dp
from conftest import batches_of, devices, mlp
from keras_dp.diagnostics import memory
from keras_dp import options

MiB, GiB = 2**20, 2**30


def test_the_auto_rule_keeps_when_the_extra_states_fit():
    # XLA:CPU (no memory reported): the kept states of all local devices
    # together at most CPU_KEEP_CAP_BYTES (1 GiB).
    assert memory.keeps_fit(128 * MiB, 1, local_devices=8)  # 1 GiB: just fits
    assert not memory.keeps_fit(128 * MiB + 1, 1, local_devices=8)
    assert not memory.keeps_fit(64 * MiB, 3, local_devices=8)  # 1.5 GiB
    # Devices that report memory: the donating step's peak plus one state
    # per call in flight, within KEEP_FRACTION (half) of the least free.
    assert memory.keeps_fit(1 * GiB, 2, free=16 * GiB, peak=6 * GiB)  # 8 of 16 GiB
    assert not memory.keeps_fit(1 * GiB, 3, free=16 * GiB, peak=6 * GiB)  # 9
    assert memory.keeps_fit(2 * GiB, 2, free=12 * GiB)  # no plan: the state, 6 of 12
    assert not memory.keeps_fit(2 * GiB, 2, free=11 * GiB)


def test_the_option_is_checked_at_once():
    assert options.check_auto("keep_last_good", None) == "auto"
    with pytest.raises(ValueError, match=r"`keep_last_good` is 'auto'.*True or False. "
                                         r"Received: keep_last_good='yes'"):
        keras_dp.ShardedTrainer(mlp(), keep_last_good="yes")


def test_fit_decides_by_the_rule_and_trains_bitwise_the_same(mnist, monkeypatch):
    (x, y), _ = mnist
    results = {}
    for cap in (memory.CPU_KEEP_CAP_BYTES, 0):  # a state of 0.3 MiB: kept, then not
        monkeypatch.setattr(memory, "CPU_KEEP_CAP_BYTES", cap)
        trainer = keras_dp.ShardedTrainer(mlp(), devices=devices(2))
        assert not trainer.keeps_last_good  # donating until a fit decides
        trainer.fit(x[:256], y[:256], batch_size=64, verbose=0)
        results[trainer.keeps_last_good] = [np.asarray(w) for w in trainer.model.get_weights()]
    assert set(results) == {True, False}
    for kept, donated in zip(results[True], results[False], strict=True):
        np.testing.assert_array_equal(kept, donated)


def test_a_kept_state_is_not_consumed_by_the_step(mnist):
    batch = batches_of(mnist, 1, size=33)[0]
    states = {}
    for keep in (True, False):
        trainer = keras_dp.ShardedTrainer(mlp(), devices=devices(2), keep_last_good=keep)
        trainer.build(batch)
        state = trainer.init_state()
        states[keep], _ = trainer.train_step(state, trainer.shard(batch))
        assert keras_dp.core.state.is_alive(state) == keep
    for kept, donated in zip(jax.tree.leaves(states[True]), jax.tree.leaves(states[False])):
        np.testing.assert_array_equal(np.asarray(kept), np.asarray(donated))


class DeviceBytes(keras.callbacks.Callback):
    """Records the bytes of the live buffers laid out on `mesh` at every batch end.

    Views of one buffer count once. Keras variables (the model's own, and
    those of models that earlier tests left to be freed at any moment) lie
    on one device, not on the mesh, and are not counted.
    """

    def __init__(self, mesh):
        super().__init__()
        self.mesh, self.bytes = mesh, []

    def on_train_batch_end(self, batch, logs=None):
        buffers = {array.unsafe_buffer_pointer(): array.nbytes for array in jax.live_arrays()
                   if getattr(array.sharding, "mesh", None) == self.mesh}
        self.bytes.append(sum(buffers.values()))


@pytest.mark.parametrize("steps_in_flight", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_keeping_costs_one_state_per_call_in_flight_and_no_more(mnist, steps_in_flight):
    (x, y), _ = mnist
    recorded, state_bytes = {}, None
    for keep in (False, True):
        trainer = keras_dp.ShardedTrainer(mlp(), devices=devices(1), keep_last_good=keep,
                                          steps_in_flight=steps_in_flight)
        record = DeviceBytes(trainer.mesh)
        gc.collect()  # earlier fits' states are gone before this one's are counted
        trainer.fit(x[:256], y[:256], batch_size=64, epochs=2, shuffle=False, verbose=0,
                    callbacks=[record])
        recorded[keep] = np.array(record.bytes)
        state_bytes = sum(memory.state_bytes(keras_dp.TrainState.abstract_of(trainer.model, trainer.state_layout())).values())
        del trainer, record
    extra = recorded[True] - recorded[False]
    assert len(extra) == 8 and state_bytes == 305_424  # the MLP's state, Adam's and metrics'
    # The last completed state beside the newest; with 2 calls in flight,
    # at most one more, never a growing number.
    assert (extra >= state_bytes).all() and (extra <= steps_in_flight * state_bytes).all()
