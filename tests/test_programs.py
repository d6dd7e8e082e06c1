"""The train and test programs, compiled once per call shape, the rest ahead of time."""

import threading
import time
from unittest import mock

import jax
import keras
import numpy as np
import pytest

import keras_dp
from keras_dp import sources as pipeline
from keras_dp import sharding as placement
from keras_dp.core import feed
from keras_dp.core import programs
from keras_dp.core import feed as resident
from keras_dp.diagnostics import timing
from conftest import devices, mlp


class Compiles:
    """XLA compilations, each with the moment it ended and its function (`jax.monitoring`)."""

    def __init__(self):
        self.ends, self.names = [], []
        jax.monitoring.register_event_duration_secs_listener(self._record)

    def _record(self, name, seconds, fun_name=None, **kwargs):
        if name == "/jax/core/compile/backend_compile_duration":
            self.ends.append(time.perf_counter())
            self.names.append(fun_name)

    def since(self, count, prefix):
        """The names after the first `count` compiles that start with `prefix`, and their ends."""
        return [(name, end) for name, end in zip(self.names[count:], self.ends[count:])
                if name.startswith(prefix)]


COMPILES = Compiles()  # listeners cannot be removed: one for the module


@pytest.fixture(autouse=True)
def no_compiles_left_over():
    """Wait for compiles ahead that earlier tests left running (non-daemon threads).

    The tests here count every compile that ends in a window; one from an
    earlier test's fit, ending late on a loaded machine, was counted too
    (4 compiles seen where 3 were made).
    """
    for thread in threading.enumerate():
        if thread.name == "keras_dp-compile":
            thread.join(timeout=300)


class CallTimes(keras.callbacks.Callback):
    """When each train call began and how long it took, callbacks aside."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.calls.append((self._start, time.perf_counter() - self._start))


def small_data(mnist, rows=200):
    (x, y), _ = mnist
    return x[:rows], y[:rows]


# Resident behind --runslow: tests/test_resident.py's fits run its programs ahead too.
@pytest.mark.parametrize("data_on_device", [
    pytest.param(False, id="host"), pytest.param(True, id="resident", marks=pytest.mark.slow)])
def test_every_program_compiles_once_and_none_at_the_epochs_end(
        mnist, data_on_device, monkeypatch):
    # In line, so that the moment each compile ends is known.
    monkeypatch.setattr(programs.CompilingFeed, "background", False)
    x, y = small_data(mnist)  # 3 full batches of 64, then 8 rows
    trainer = keras_dp.ShardedTrainer(mlp(), devices=devices(2), steps_per_execution=2,
                                      data_on_device=data_on_device)
    calls = CallTimes()
    trainer.fit(x, y, batch_size=64, epochs=2, verbose=0, callbacks=[calls])
    # Calls per epoch: 2 steps of 64 rows, 1 of 64, 1 of 8: three programs.
    assert feed.planned_calls(trainer.batches_of(x, y, None, 64, True), 2) == [
        (2, 64), (1, 64), (1, 8)]
    def compiled_during(call):
        start, seconds = calls.calls[call]
        return [end for end in COMPILES.ends if start <= end <= start + seconds]

    # Each program once (jax.jit reused what was compiled), all three in the
    # epoch's first call: its own program, then the rest.
    assert len(compiled_during(0)) == 3
    assert not any(compiled_during(call) for call in range(1, len(calls.calls)))
    assert calls.calls[3][1] < 0.25 * calls.calls[0][1]  # the remainder's call


def fit_small(x, y):
    """A 1-epoch fit of three programs (2 steps of 64 rows, 1 of 64, 1 of 8), and its compiles."""
    trainer = keras_dp.ShardedTrainer(mlp(), devices=devices(2), steps_per_execution=2,
                                      data_on_device=False)
    calls = CallTimes()
    trainer.fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=[calls])
    start, (last, seconds) = calls.calls[0][0], calls.calls[-1]
    return trainer, [end for end in COMPILES.ends if start <= end <= last + seconds]


def weights(trainer):
    return [np.asarray(variable) for variable in trainer.model.weights]


def test_ahead_of_time_trains_bitwise_as_jit_alone_and_counts_its_flops(mnist, monkeypatch):
    x, y = small_data(mnist)
    trainer, compiled = fit_small(x, y)  # the rest compiled in the background
    assert len(compiled) == 3  # each program once, all before the epoch's last call ended
    with monkeypatch.context() as patch:
        patch.setattr(programs.CompilingFeed, "call",
                      lambda self, state, steps, batch: programs.run_call(
                          self._feed, state, steps, batch))
        plain, compiled = fit_small(x, y)
    assert len(compiled) == 3  # jax.jit alone
    assert all(np.array_equal(a, b)
               for a, b in zip(weights(trainer), weights(plain), strict=True))

    state = trainer.init_state()

    def flops(steps, rows):  # the jit cache has each program: no compile here
        batch = (x[:rows], y[:rows], None)
        if steps == 1:
            lowered = trainer.programs.train_step.lower(state, placement.to_device(batch, trainer.layout))
        else:
            lowered = trainer.programs.train_steps.lower(
                state, placement.to_device_stacked([batch] * steps, trainer.layout))
        return programs.cost_flops(lowered.compile())  # per device

    per_call = {call: flops(*call) for call in [(2, 64), (1, 64), (1, 8)]}
    entry = trainer.timings[0]
    assert entry["flops"] == 2 * sum(per_call.values())  # 2 devices, one call each
    # A call of K steps counts K steps (the scan is unrolled on CPU).
    assert per_call[(2, 64)] == pytest.approx(2 * per_call[(1, 64)], rel=0.01)
    training = entry["wall_s"] - entry["validation_s"]
    assert entry["flops_per_s"] == pytest.approx(entry["flops"] / training)
    assert entry["peak_flops_per_s"] is None and entry["fraction_of_peak"] is None  # CPU


@pytest.mark.slow  # a third fit; the bitwise test covers the path that works
def test_a_program_that_fails_to_compile_ahead_compiles_at_its_call(mnist, monkeypatch):
    x, y = small_data(mnist)
    plain, _ = fit_small(x, y)

    def fail(*args):
        raise RuntimeError("cannot compile ahead")

    # As under jax.jit alone, and the state the first call made is kept.
    monkeypatch.setattr(programs, "like_batch", fail)
    late, _ = fit_small(x, y)
    assert all(np.array_equal(a, b) for a, b in zip(weights(plain), weights(late), strict=True))


class FakeCompiled:
    def __init__(self, flops):
        self.flops = flops

    def cost_analysis(self):
        return {"flops": self.flops}


@pytest.mark.parametrize("unroll, steps, scale", [
    (4, 4, 1), (0, 4, 1), (1, 4, 4), (2, 4, 2), (2, 5, 5 / 3), (3, 1, 1)])
def test_a_rolled_scan_counts_every_step(unroll, steps, scale):
    # XLA counts a loop body once: K steps scanned `unroll` at a time
    # count `unroll + K % unroll` of them.
    trainer = keras_dp.ShardedTrainer(mlp(), devices=devices(2), unroll=unroll)
    feed = programs.CompilingFeed(None, None, layout=trainer.layout, unroll=trainer.unroll,
                                  steps_per_execution=trainer.steps_per_execution)
    assert feed._call_flops(FakeCompiled(10.0), steps) == pytest.approx(2 * 10.0 * scale)
    assert feed._call_flops(FakeCompiled(0), steps) is None


class FakeDevice:
    def __init__(self, kind):
        self.device_kind = kind


class FakeMesh:
    def __init__(self, kind, count):
        self.devices = np.array([FakeDevice(kind)] * count)


@pytest.mark.parametrize("kind, policy, peak", [
    ("NVIDIA H100 80GB HBM3", "mixed_bfloat16", 989e12),
    ("NVIDIA H100 80GB HBM3", "float32", 494e12),
    ("NVIDIA H100 PCIe", "mixed_float16", 756e12),
    ("NVIDIA H200", "mixed_bfloat16", 989e12),
    ("NVIDIA A100-SXM4-40GB", "float32", 156e12),
    ("TPU v5 lite", "float32", 197e12),
    ("TPU v4", "mixed_bfloat16", 275e12),
    ("cpu", "float32", None),
    ("NVIDIA GeForce RTX 3090", "float32", None),
])
def test_peak_flops_by_device_kind_and_dtype_policy(kind, policy, peak):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.dtype_policy = keras.DTypePolicy(policy)
    got = timing.peak_flops_per_s(FakeMesh(kind, 4), model)
    assert got == (None if peak is None else 4 * peak)


def test_describe_shows_flops_and_the_fraction_of_peak_where_known():
    entry = {"epoch": 0, "wall_s": 2.0, "input_s": 0.1, "steps_s": 1.5, "callbacks_s": 0.1,
             "validation_s": 0.2, "other_s": 0.1, "samples_per_s": 1000.0,
             "flops_per_s": 3.5e12, "fraction_of_peak": 0.25}
    assert timing.describe(entry).endswith("1,000 samples/s, 3.5 TFLOP/s (25.0% of peak)")
    entry.update(flops_per_s=2.5e9, fraction_of_peak=None)
    assert timing.describe(entry).endswith("1,000 samples/s, 2.5 GFLOP/s")
    entry.update(flops_per_s=None)
    assert timing.describe(entry).endswith("1,000 samples/s")


class ValidationTimes(keras.callbacks.Callback):
    """When each validation (or evaluation) began."""

    def __init__(self):
        super().__init__()
        self.begins = []

    def on_test_begin(self, logs=None):
        self.begins.append(time.perf_counter())


def fit_validated(mnist, data_on_device=False):
    """2 epochs, K=4: train calls (4, 64) and (1, 44); validation (4, 64), (1, 64), (1, 8)."""
    (x, y), (x_val, y_val) = mnist
    trainer = keras_dp.ShardedTrainer(mlp(), devices=devices(2), steps_per_execution=4,
                                      data_on_device=data_on_device)
    calls, tests, before = CallTimes(), ValidationTimes(), len(COMPILES.names)
    history = trainer.fit(x[:300], y[:300], batch_size=64, epochs=2, verbose=0,
                          validation_data=(x_val[:328], y_val[:328]), callbacks=[calls, tests])
    return trainer, history.history, calls, tests, before


@pytest.mark.parametrize("data_on_device", [
    pytest.param(False, id="host"), pytest.param(True, id="resident", marks=pytest.mark.slow)])
def test_validation_programs_compile_once_during_the_first_call_and_score_as_before(
        mnist, data_on_device, monkeypatch):
    monkeypatch.setattr(programs.CompilingFeed, "background", False)  # ends in a known call
    trainer, history, calls, tests, before = fit_validated(mnist, data_on_device)
    x_val, y_val = mnist[1]
    val = trainer.batches_of(x_val[:328], y_val[:328], None, 64, False)
    assert programs.eval_plan(val, 4) == [(4, 64), (1, 64), (1, 8)]
    test_compiles = COMPILES.since(before, "jit(test_step")
    # Each validation program once, all in epoch 1's first train call.
    assert sorted(name for name, _ in test_compiles) == [
        "jit(test_step)", "jit(test_step)", "jit(test_steps)"]
    start, seconds = calls.calls[0]
    assert all(start <= end <= start + seconds < tests.begins[0] for _, end in test_compiles)
    assert not COMPILES.since(before, "jit(test")[3:]

    # Validation as it ran before: each program compiled by jax.jit at its first call.
    monkeypatch.setattr(programs.EvalPrograms, "ahead", False)
    _, plain, _, plain_tests, before = fit_validated(mnist, data_on_device)
    late = COMPILES.since(before, "jit(test_step")
    assert len(late) == 3 and all(end > plain_tests.begins[0] for _, end in late)
    for name in ("val_loss", "val_accuracy"):
        assert history[name] == plain[name]  # python floats, bitwise


def test_evaluate_and_predict_compile_each_program_once(mnist):
    _, (x, y) = mnist
    x, y = x[:328], y[:328]  # calls of 4 batches of 64, 1 of 64, 1 of 8
    trainer = keras_dp.ShardedTrainer(mlp(), devices=devices(2), steps_per_execution=4)
    before = len(COMPILES.names)
    first = trainer.evaluate(x, y, batch_size=64, verbose=0, return_dict=True)
    again = trainer.evaluate(x, y, batch_size=64, verbose=0, return_dict=True)
    outputs = trainer.predict(x, batch_size=64, verbose=0)
    trainer.predict(x, batch_size=64, verbose=0)
    assert sorted(name for name, _ in COMPILES.since(before, "jit(test")) == [
        "jit(test_step)", "jit(test_step)", "jit(test_steps)"]
    assert sorted(name for name, _ in COMPILES.since(before, "jit(predict")) == [
        "jit(predict_step)", "jit(predict_step)", "jit(predict_steps)"]
    assert first == again
    correct = np.sum(np.argmax(outputs, axis=1) == y)
    assert first["accuracy"] == pytest.approx(correct / len(y), abs=1e-6)


def test_a_datasets_plan_is_its_first_batchs_calls():
    batch = (np.zeros((64, 28, 28, 1), "uint8"), np.zeros(64, "int64"), None)
    dataset = pipeline.make_batches([batch[:2]] * 5)
    assert programs.eval_plan(dataset, 4) == [(4, 64)]
    assert programs.eval_plan(dataset, 1) == [(1, 64)]

    class Two(keras.utils.PyDataset):  # known to hold fewer batches than K
        def __len__(self):
            return 2

        def __getitem__(self, index):
            return batch[:2]

    assert programs.eval_plan(pipeline.make_batches(Two()), 4) == [(1, 64)]
    like = placement.abstract_batch(dataset.peek(), 64,
                                  placement.Layout(keras_dp.make_mesh(devices(2))), 4)
    assert [(leaf.shape, str(leaf.dtype)) for leaf in jax.tree.leaves(like)] == [
        ((4, 64, 28, 28, 1), "uint8"), ((4, 64), "int32")]  # as JAX places them


class BlockingLowered:
    """A lowered program whose `compile` says it `started`, waits for `release`, and records itself."""

    def __init__(self, started, release, compiled):
        self.started, self.release, self.compiled = started, release, compiled

    def compile(self):
        self.started.set()
        self.release.wait(60)
        self.compiled.append(self)
        return FakeCompiled(1.0)


def test_compiles_ahead_of_an_ended_fit_are_cancelled_and_python_waits_for_the_running_one():
    # A daemon thread killed mid-compile at exit (after Ctrl-C in a fit with
    # programs still to compile) aborted Python: "terminate called after
    # throwing an instance of ''", status 134.
    started, release, compiled, store = threading.Event(), threading.Event(), [], {}
    lowered = [BlockingLowered(started, release, compiled) for _ in range(3)]
    programs.compile_ahead([(store, key, low) for key, low in enumerate(lowered)])
    [thread] = [t for t in threading.enumerate() if t.name == "keras_dp-compile"]
    assert not thread.daemon  # Python's exit waits for it
    assert started.wait(60)
    programs.cancel_ahead(store)  # as the fit's end does: key 0 is compiling already
    release.set()
    thread.join(60)
    assert not thread.is_alive() and compiled == lowered[:1]
    assert isinstance(programs.finished(store, 0), FakeCompiled)
    assert programs.finished(store, 1) is None and programs.finished(store, 2) is None


def test_a_fit_after_memory_plan_runs_the_step_the_plan_compiled():
    # On XLA:CPU the plan is of the step the fit keeps or donates with, so
    # the fit finds it compiled instead of compiling the same step again.
    x = np.random.default_rng(0).integers(0, 255, (64, 28, 28, 1), dtype=np.uint8)
    y = np.arange(64) % 10
    trainer = keras_dp.ShardedTrainer(mlp(), devices=devices(2), data_on_device=False)
    count = len(COMPILES.names)
    plan = trainer.memory_plan(x[:5], y[:5], batch_size=16)
    assert [name for name, _ in COMPILES.since(count, "jit(train_step)")] == [
        "jit(train_step)"]
    assert plan.arguments > 0 and plan.peak >= plan.arguments
    count = len(COMPILES.names)
    trainer.fit(x, y, batch_size=16, epochs=1, verbose=0)  # 4 whole batches
    assert COMPILES.since(count, "jit(train_step)") == []


def test_a_memory_plan_of_resident_data_is_of_the_step_the_fit_runs():
    # With the whole training data and data_on_device, the plan is of the
    # step over the data kept on the devices (its arguments hold the data,
    # replicated), and the fit finds that step compiled.
    x = np.random.default_rng(0).integers(0, 255, (64, 28, 28, 1), dtype=np.uint8)
    y = np.arange(64) % 10
    trainer = keras_dp.ShardedTrainer(mlp(), devices=devices(2))
    host = trainer.memory_plan(x[:5], y[:5], batch_size=16)
    count = len(COMPILES.names)
    plan = trainer.memory_plan(x, y, batch_size=16, data_on_device="auto")
    assert [name for name, _ in COMPILES.since(count, "jit(train_step)")] == [
        "jit(train_step)"]
    # The resident arguments: all 64 rows of x (uint8) and y (int32), the
    # epoch's order (64 int32s) and the call's start (one); the host step's,
    # 8 rows of x and y per device.
    data = x.nbytes + 64 * 4 + 64 * 4 + 4
    assert plan.arguments - host.arguments == data - 8 * (28 * 28 + 4)
    assert plan.resident_data == x.nbytes + 64 * 4 and host.resident_data == 0
    assert "over the training data kept on the devices (49.2 KiB" in str(plan)
    assert "fed from the host" in str(host)
    count = len(COMPILES.names)
    trainer.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=True)
    assert COMPILES.since(count, "jit(train_step)") == []
    # Data a fit could not keep there: True is refused as a fit refuses it.
    small = keras_dp.ShardedTrainer(mlp(), devices=devices(2))
    with mock.patch.object(resident, "CPU_CAP_BYTES", 1000), pytest.raises(
            ValueError, match="data_on_device=True cannot keep this data"):
        small.memory_plan(x, y, batch_size=16, data_on_device=True)


def test_placing_and_writing_back_the_state_compile_one_copy_program_each():
    # `jnp.copy` on each variable compiled a program per distinct shape, in
    # every process: 13 for the convnet when the state was placed, as many
    # again at its first write-back. Shapes no other test uses, so no
    # program is in JAX's in-memory cache already.
    model = keras.Sequential([keras.Input((13,)), keras.layers.Dense(7), keras.layers.Dense(3)])
    model.compile(optimizer="adam", loss="mse")
    x = np.random.default_rng(0).normal(size=(8, 13)).astype("float32")
    count = len(COMPILES.names)
    keras_dp.fit_sharded(model, x, np.zeros((8, 3), "float32"), batch_size=4, verbose=0,
                         devices=devices(2))
    copies = [name for name, _ in COMPILES.since(count, "jit(") if "copy" in name
              or "lambda" in name]
    assert "jit(copy)" not in copies, copies
    assert len(copies) <= 4, copies  # placed weights, optimizer, metrics; written back
