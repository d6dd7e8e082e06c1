"""Memory you can plan: micro-batches, the plan's remedies, a refusal before the first step, remat."""

import contextlib
import json
import os
import pathlib
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_dp
from conftest import assert_close_to_scale, devices

SCRIPTS = pathlib.Path(__file__).parent / "scripts"


def dense_stack(width=128, depth=6, remat=False, optimizer="sgd"):
    """A model whose step's temporaries are mostly activations (wide batches, few weights)."""
    keras.utils.set_random_seed(0)
    scope = keras.RematScope(mode="full") if remat else contextlib.nullcontext()
    with scope:
        model = keras.Sequential(
            [keras.Input((width,))]
            + [keras.layers.Dense(width, activation="gelu") for _ in range(depth)]
            + [keras.layers.LayerNormalization(), keras.layers.Dense(10)])
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def rows(count, width=128, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(count, width)).astype("float32"), rng.integers(0, 10, count)


def test_micro_batches_train_as_whole_batches(monkeypatch):
    # 3 devices, batches of 50 then 30 rows, 4 micro-batches of 12 (+2) and
    # 7 (+2): one update per batch, the same weights up to summation order.
    x, y = rows(130, width=16)
    results = {}
    for micro in (1, 4):
        model = dense_stack(width=16, depth=2, optimizer="adam")
        history = keras_dp.fit_sharded(model, x, y, batch_size=50, epochs=2, shuffle=False,
                                       verbose=0, devices=devices(3), micro_batches=micro)
        results[micro] = (model, history.history)
    (whole, whole_history), (sliced, sliced_history) = results[1], results[4]
    assert int(sliced.optimizer.iterations.numpy()) == 6  # 3 batches x 2 epochs
    for a, b in zip(whole.weights, sliced.weights, strict=True):
        assert_close_to_scale(np.asarray(b), np.asarray(a))
    np.testing.assert_allclose(sliced_history["loss"], whole_history["loss"], rtol=1e-5)
    assert sliced_history["accuracy"] == whole_history["accuracy"]


@pytest.mark.slow  # 30 s: Keras's fit and five of keras_dp's (one on a model axis), float64
def test_micro_batches_equal_keras_fit_on_one_device_in_float64():
    result = subprocess.run([sys.executable, str(SCRIPTS / "micro_float64.py")],
                            capture_output=True, text=True, timeout=280,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                filter(None, [str(SCRIPTS), os.environ.get("PYTHONPATH")]))})
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["dtype"] == "float64" and report["keras_iterations"] == 10
    assert set(report["runs"]) == {f"micro_batches={m}, K={k}" for m in (1, 4) for k in (1, 4)} | {
        "ModelParallel 2x2, micro_batches=4"}
    assert report["runs"]["ModelParallel 2x2, micro_batches=4"]["kernel_spec"] == "P(None, 'model')"
    for run in report["runs"].values():
        assert run["iterations"] == 10
        assert run["max_relative"] < 1e-9, run
        np.testing.assert_allclose(run["loss"], report["keras_loss"], rtol=1e-12)


def test_the_steps_temporaries_fall_as_micro_batches_grow():
    x, y = rows(8)
    plans = {micro: keras_dp.memory_plan(dense_stack(), x, y, batch_size=8192,
                                         devices=devices(2), micro_batches=micro)
             for micro in (1, 2, 4)}
    temporaries = [plans[micro].temporaries for micro in (1, 2, 4)]
    assert temporaries[0] > temporaries[1] > temporaries[2]
    assert temporaries[2] < 0.4 * temporaries[0]  # about 1/M of the activations
    assert plans[4].micro_batches == 4 and "micro_batches=4" in str(plans[4])
    assert len({plan.weights for plan in plans.values()}) == 1  # the state is the same


def test_a_model_built_under_remat_scope_plans_fewer_temporaries_and_trains_the_same():
    x, y = rows(8)
    plain, remat = (keras_dp.memory_plan(dense_stack(remat=flag), x, y, batch_size=8192,
                                         devices=devices(2)) for flag in (False, True))
    assert remat.temporaries < 0.8 * plain.temporaries, (plain.temporaries, remat.temporaries)
    assert remat.weights == plain.weights
    x, y = rows(96, width=128, seed=1)
    trained = []
    for flag in (False, True):
        model = dense_stack(remat=flag)
        keras_dp.fit_sharded(model, x, y, batch_size=32, verbose=0, devices=devices(2))
        trained.append([np.asarray(w) for w in model.weights])
    for a, b in zip(*trained, strict=True):
        assert_close_to_scale(b, a)


def test_layers_whose_statistics_span_the_batch_refuse_micro_batches():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                              keras.layers.BatchNormalization(name="norm"),
                              keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    x = np.zeros((16, 4), "float32")
    with pytest.raises(ValueError, match=r"micro_batches=2 runs each batch as 2 slices.*"
                       r"norm \(BatchNormalization\).*a slice's are not the batch's"):
        keras_dp.fit_sharded(model, x, np.zeros((16, 2)), micro_batches=2, verbose=0,
                             devices=devices(2))
    assert int(model.optimizer.iterations.numpy()) == 0
    with pytest.raises(ValueError, match="`micro_batches` must be at least 1"):
        keras_dp.ShardedTrainer(model, devices=devices(2), micro_batches=0)


def test_a_step_that_does_not_fit_the_capacity_is_refused_before_the_first_step(monkeypatch):
    from keras_dp.diagnostics import memory

    x, y = rows(8)
    plan = keras_dp.memory_plan(dense_stack(), x, y, batch_size=8192, devices=devices(2))
    capacity = int(plan.peak * 0.6)  # the whole batch does not fit; 4 slices of it do
    planned = keras_dp.memory_plan(dense_stack(), x, y, batch_size=8192, devices=devices(2),
                                   capacity=capacity)
    assert not planned.fits() and planned.capacity == capacity
    fixes = dict(planned.remedies)
    assert set(fixes) >= {"state_sharding='optimizer'", "state_sharding='full'",
                          "micro_batches=2", "micro_batches=4", "micro_batches=8",
                          "batch_size=4096"}
    assert fixes["micro_batches=4"].peak < capacity < planned.peak  # 4 slices fit
    assert fixes["micro_batches=4"].fits() and fixes["micro_batches=4"].micro_batches == 4
    assert fixes["batch_size=4096"].batch_size == 4096
    assert "with micro_batches=4: peak" in str(planned)

    # A fit on a device that reports this capacity refuses before any step.
    monkeypatch.setattr(memory, "device_capacity", lambda device: capacity)
    model = dense_stack()
    big_x, big_y = rows(8192)
    with pytest.raises(MemoryError) as refused:
        keras_dp.fit_sharded(model, big_x, big_y, batch_size=8192, verbose=0,
                             devices=devices(2))
    message = str(refused.value)
    assert message.startswith("One train step needs ")
    assert f"the device has {capacity / 2**30:.2f} GiB" in message
    assert "These fit: " in message and "micro_batches=4" in message.split("These fit: ")[1]
    assert int(model.optimizer.iterations.numpy()) == 0
