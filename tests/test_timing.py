"""Where an epoch's time goes (`keras_dp.diagnostics.timing`), and the profiler trace."""

import time

import jax
import keras
import pytest

import keras_dp
from keras_dp.diagnostics import timing
from conftest import devices, mlp


class EpochClock(keras.callbacks.Callback):
    """Each epoch's wall time, from `on_epoch_begin` to `on_epoch_end`."""

    def __init__(self):
        super().__init__()
        self.walls = []

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.walls.append(time.perf_counter() - self.start)


def test_the_epoch_breakdown_adds_up_to_the_epochs_wall_time(mnist):
    (x, y), (x_test, y_test) = mnist
    trainer = keras_dp.ShardedTrainer(mlp(), devices=devices(2), data_on_device=False)
    clock = EpochClock()
    trainer.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[clock],
                validation_data=(x_test[:256], y_test[:256]))
    assert [entry["epoch"] for entry in trainer.timings] == [0, 1]
    for entry, wall in zip(trainer.timings, clock.walls, strict=True):
        # The parts add up to the epoch's wall time, whose window (from
        # before on_epoch_begin to after on_epoch_end) holds the callback's.
        # No share of the parts is asserted: `other_s` holds the wait for
        # the last step's logs, which grows with the machine's load.
        parts = sum(entry[part] for part in timing.PARTS)
        assert entry["wall_s"] == pytest.approx(parts + entry["other_s"])
        assert entry["wall_s"] >= wall and min(entry[p] for p in timing.PARTS) >= 0, entry
        assert entry["steps_s"] > 0 and entry["validation_s"] > 0 and entry["input_s"] > 0
        assert entry["samples"] == len(x)
        training = entry["wall_s"] - entry["validation_s"]
        assert entry["samples_per_s"] == pytest.approx(len(x) / training)
        # 64 calls of one step of 32 rows, from XLA's count of the program.
        assert entry["flops"] > 0 and entry["flops_per_s"] == pytest.approx(
            entry["flops"] / training)
        assert entry["fraction_of_peak"] is None  # no known peak on CPU
    assert trainer.timings[0]["flops"] == trainer.timings[1]["flops"]


def test_profile_dir_gets_a_trace_of_the_first_epoch(mnist, tmp_path):
    (x, y), _ = mnist
    trainer = keras_dp.ShardedTrainer(mlp(), devices=devices(2))
    trainer.fit(x[:640], y[:640], batch_size=64, verbose=0, profile_dir=tmp_path / "profile")
    written = [path for path in (tmp_path / "profile").rglob("*") if path.is_file()]
    assert any(path.name.endswith(".xplane.pb") for path in written)
    assert all(path.stat().st_size > 0 for path in written)
    # The trace was stopped: a new one can start.
    jax.profiler.start_trace(str(tmp_path / "again"))
    jax.profiler.stop_trace()


class SlowEpochEnd(keras.callbacks.Callback):
    """Sleeps `seconds` in each `on_epoch_end`."""

    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    def on_epoch_end(self, epoch, logs=None):
        time.sleep(self.seconds)


def test_a_slow_callback_and_k_steps_per_call_are_counted_where_they_ran(mnist):
    (x, y), (x_test, y_test) = mnist
    # Resident data (the default for these arrays), 4 steps per call: 32
    # steps of 64 rows in 8 calls; the clock runs after the slow callback.
    trainer = keras_dp.ShardedTrainer(mlp(), devices=devices(2), steps_per_execution=4)
    clock = EpochClock()
    trainer.fit(x, y, batch_size=64, epochs=2, verbose=0, callbacks=[SlowEpochEnd(0.3), clock],
                validation_data=(x_test[:256], y_test[:256]))
    for entry, wall in zip(trainer.timings, clock.walls, strict=True):
        parts = sum(entry[part] for part in timing.PARTS)
        assert parts == pytest.approx(wall, rel=0.05), entry
        assert entry["wall_s"] == pytest.approx(parts + entry["other_s"])
        assert entry["callbacks_s"] >= 0.3 and entry["validation_s"] > 0, entry
        assert entry["samples"] == len(x)
        assert entry["samples_per_s"] == pytest.approx(
            len(x) / (entry["wall_s"] - entry["validation_s"]))
