"""Models that customise training train as their authors wrote them.

A GAN (no `call()`, two sub-models, two optimizers, its own stateless
`train_step`, metrics as attributes), a VAE (loss and KL term computed in its
`train_step`), a model whose only loss is `add_loss`, and a model with its own
`test_step` (builders in `tests/parity_models.py`), each against Keras's own
`model.fit` / `model.evaluate` on one device. 155 rows in batches of 50: the
last batch has 5 rows, and 50 does not divide by 3, so the uneven cut runs.
"""

import json
import os
import pathlib
import subprocess
import sys

import jax
import keras
import numpy as np
import pytest

import keras_dp
import parity_models
from conftest import assert_close_to_scale
from conftest import assert_weights_close
from conftest import devices

SCRIPT = pathlib.Path(__file__).parent / "scripts" / "custom_steps.py"
OPTIONS = dict(batch_size=50, epochs=2, shuffle=False, verbose=0)


@pytest.fixture(scope="module")
def data():
    return parity_models.mnist_like(155)


def _inputs(name, data):
    images, labels = data
    return {"image": images, "label": labels} if name == "add_loss_model" else images


def _assert_variables_close(reference, ours, scale_tolerance, floor=0.0):
    """Every variable within `scale_tolerance` of its own largest value, or within `floor`."""
    for a, b in zip(reference.variables, ours.variables, strict=True):
        a, b = np.asarray(a.value, np.float64), np.asarray(b.value, np.float64)
        if a.size:
            largest = float(np.max(np.abs(a)))
            if floor > scale_tolerance * largest:
                np.testing.assert_allclose(b, a, rtol=0, atol=floor, err_msg=reference.name)
            else:
                assert_close_to_scale(b, a, scale=scale_tolerance)


# float32 here on 2 or 3 devices; all three on 3 devices in float64 below.
@pytest.mark.parametrize("name,n_devices", [
    pytest.param("dcgan", 3, marks=pytest.mark.slow),
    pytest.param("vae", 2, marks=pytest.mark.slow), ("add_loss_model", 2)])
def test_a_custom_step_model_trains_as_keras_fit_on_one_device(data, name, n_devices):
    build = getattr(parity_models, name)
    reference = build(0)
    expected = reference.fit(_inputs(name, data), **OPTIONS).history
    ours = build(0)
    history = keras_dp.fit_sharded(ours, _inputs(name, data), devices=devices(n_devices), **OPTIONS)
    assert sorted(history.history) == sorted(expected)
    for key, values in expected.items():
        np.testing.assert_allclose(history.history[key], values, rtol=1e-5)
    # add_loss_model: measured 4.3e-6 of scale. The GAN's biases start at 0
    # and hold only Adam's steps (3e-4 each), and Adam takes a whole step
    # even where the gradient is as small as its float32 rounding (the
    # generator's border pixels): on an Intel Xeon an entry was 8e-6 apart,
    # 3.5e-3 of its variable's scale. There, within a tenth of one step;
    # exactness is the float64 test's (below: 1e-10).
    _assert_variables_close(reference, ours, 1e-4, floor=3e-5 if name == "dcgan" else 0.0)
    if name == "dcgan":  # both optimizers stepped, the latent draws advanced exactly
        assert int(ours.d_optimizer.iterations.value) == 8
        assert int(ours.g_optimizer.iterations.value) == 8
        np.testing.assert_array_equal(np.asarray(ours.seed_generator.state.value),
                                      np.asarray(reference.seed_generator.state.value))


def test_custom_test_step_evaluates_as_model_evaluate(data):
    images, labels = data
    expected = parity_models.eval_model(0).evaluate(images, labels, batch_size=50, verbose=0)
    trainer = keras_dp.ShardedTrainer(parity_models.eval_model(0), devices=devices(3))
    got = trainer.evaluate(images, labels, batch_size=50, verbose=0)
    assert len(got) == len(expected) == 3  # loss, acc, then the step's own batch_rows
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert got[2] == 5.0  # the last batch's real rows: the step never sees padding


def test_an_overridden_step_is_never_skipped():
    class OnlyData(keras.Model):
        def train_step(self, data):  # the TensorFlow form
            return {}

    model = OnlyData()
    with pytest.raises(TypeError, match="TensorFlow form.*train_step.self, state, data"):
        keras_dp.ShardedTrainer(model, optimizer="sgd", loss="mse")


def test_a_model_without_call_and_unbuilt_sub_models_names_them():
    class NoCall(keras.Model):
        def __init__(self):
            super().__init__()
            self.inner = keras.layers.Dense(2, name="unbuilt_dense")

        def train_step(self, state, data):
            return {}, state

    with pytest.raises(ValueError, match="no call.*unbuilt_dense"):
        keras_dp.fit_sharded(NoCall(), np.ones((4, 3)), optimizer="sgd", verbose=0)


@pytest.mark.parametrize("models", [
    pytest.param("add_loss_model", marks=pytest.mark.slow),
    pytest.param("dcgan,vae", marks=pytest.mark.slow)])
def test_float64_custom_steps_equal_keras_fit_to_rounding(models):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--float64", "--devices", "3", "--models", models],
        capture_output=True, text=True, timeout=400, env=dict(os.environ),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    runs = {run["model"]: run for run in map(json.loads, (
        line for line in result.stdout.splitlines() if line.startswith("{")))}
    assert sorted(runs) == sorted(models.split(","))
    for name, run in runs.items():
        assert run["dtype"] == "float64"
        assert run["relative_difference"] <= 1e-10, (name, run["relative_difference"])


class BatchLossLogged(keras.Model):
    """Keeps the running loss in a `Mean` named "loss" but logs each batch's loss."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tracker = keras.metrics.Mean(name="loss")

    @property
    def metrics(self):
        return [self.tracker]

    def _loss(self, trainable, non_trainable, data, training):
        x, y = data
        y_pred, non_trainable = self.stateless_call(trainable, non_trainable, x, training=training)
        return keras.ops.mean(keras.ops.square(y - y_pred)), non_trainable

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_variables, metrics = state
        (loss, non_trainable), grads = jax.value_and_grad(self._loss, has_aux=True)(
            trainable, non_trainable, data, True)
        trainable, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable)
        metrics = self.tracker.stateless_update_state(metrics, loss)
        return {"loss": loss}, (trainable, non_trainable, optimizer_variables, metrics)

    def test_step(self, state, data):
        trainable, non_trainable, metrics = state
        loss, non_trainable = self._loss(trainable, non_trainable, data, False)
        return {"loss": loss}, (trainable, non_trainable,
                                self.tracker.stateless_update_state(metrics, loss))


def _batch_loss_logged(steps_per_execution):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    model = BatchLossLogged(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", steps_per_execution=steps_per_execution)
    return model


@pytest.mark.parametrize("steps_per_execution", [1, 2])
def test_logs_named_as_the_metrics_report_the_metrics_as_keras_does(steps_per_execution):
    # Keras's fit and evaluate report the metrics' results, not the last
    # step's logs, when the names match (`_get_metrics_result_or_logs`):
    # here the running mean of the loss, where the last batch's was reported.
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, 8)).astype("float32"), rng.normal(size=(40, 1)).astype("float32")
    options = dict(batch_size=16, epochs=2, shuffle=False, verbose=0,
                   validation_data=(x[:20], y[:20]))
    reference = _batch_loss_logged(steps_per_execution)
    expected = reference.fit(x, y, **options).history
    ours = _batch_loss_logged(steps_per_execution)
    got = keras_dp.fit_sharded(ours, x, y, devices=devices(3), **options).history
    assert list(got) == list(expected) == ["loss", "val_loss"]
    for key, values in expected.items():
        np.testing.assert_allclose(got[key], values, rtol=1e-5)
    _assert_variables_close(reference, ours, 1e-5)
    evaluated = keras_dp.ShardedTrainer(ours, devices=devices(3)).evaluate(
        x, y, batch_size=16, verbose=0)
    np.testing.assert_allclose(evaluated, reference.evaluate(x, y, batch_size=16, verbose=0),
                               rtol=1e-5)


class LogisticEndpoint(keras.layers.Layer):
    """keras.io's endpoint layer, with the metric it updates in `call()`."""

    def __init__(self, name=None):
        super().__init__(name=name)
        self.accuracy = keras.metrics.SparseCategoricalAccuracy(name="endpoint_accuracy")

    def call(self, targets, logits):
        self.add_loss(keras.ops.mean(keras.losses.sparse_categorical_crossentropy(
            targets, logits, from_logits=True)))
        self.accuracy.update_state(targets, logits)
        return keras.ops.softmax(logits)


def test_a_metric_updated_in_call_is_refused_naming_the_layer():
    # Its update never leaves Keras's stateless call: keras_dp logged it as
    # 0.0 for every epoch; model.fit fails ("'NoneType' object is not callable").
    inputs = {"image": keras.Input((4,), name="image"),
              "target": keras.Input((), dtype="int32", name="target")}
    outputs = LogisticEndpoint(name="endpoint")(inputs["target"], keras.layers.Dense(3)(inputs["image"]))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="sgd")
    with pytest.raises(ValueError, match=r"Layer 'endpoint' updates its metric "
                       r"'endpoint_accuracy' in call\(\).*compute_metrics") as error:
        keras_dp.fit_sharded(model, {"image": np.ones((8, 4), "float32"),
                                     "target": np.zeros(8, "int32")}, verbose=0, devices=devices(2))
    assert error.value.__cause__ is None


class ScaledLoss(keras.Model):
    """A model with a compile of its own, whose `alpha` scales the compiled loss."""

    def compile(self, alpha=1.0, **kwargs):
        super().compile(**kwargs)
        self.alpha = alpha

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return self.alpha * super().compute_loss(x, y, y_pred, sample_weight, training)


@pytest.mark.parametrize("override", [dict(metrics=["mae"]),
                                      dict(optimizer=keras.optimizers.Adam(), loss="mae")])
def test_a_model_with_its_own_compile_is_not_recompiled_without_its_arguments(override):
    # keras_dp's optimizer=/loss=/metrics= recompiled through the model's own
    # compile without its alpha: reset to 1.0, the loss trained 10x larger
    # than the user's compile(alpha=0.1) asked, without a word (a keras.io
    # Distiller's compile, with required arguments, failed inside keras_dp).
    model = _scaled_loss(override.get("metrics"))
    x, y = np.ones((8, 3), "float32"), np.ones((8, 1), "float32")
    with pytest.raises(ValueError, match=r"ScaledLoss defines its own compile\(\).*\(alpha\).*"
                       r"Received: (metrics=\['mae'\]|optimizer=Adam\(\.\.\.\), loss='mae')\. "
                       r"Compile the model yourself"):
        keras_dp.fit_sharded(model, x, y, verbose=0, devices=devices(2), **override)
    assert model.alpha == 0.1 and model.loss == "mse"  # untouched
    # The fix, compiling it yourself, trains as model.fit.
    reference, ours = _scaled_loss(["mae"]), _scaled_loss(["mae"])
    expected = reference.fit(x, y, batch_size=4, shuffle=False, verbose=0).history
    got = keras_dp.fit_sharded(ours, x, y, batch_size=4, shuffle=False, verbose=0,
                               devices=devices(2)).history
    assert sorted(got) == sorted(expected) == ["loss", "mae"]
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-6)


def _scaled_loss(metrics):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    model = ScaledLoss(inputs, keras.layers.Dense(1)(inputs))
    model.compile(alpha=0.1, optimizer="sgd", loss="mse", metrics=metrics)
    return model


class LossPerOutput(keras.Model):
    """Logs its `loss` as one value per output column, as a step of one's own may."""

    def train_step(self, state, data):
        x, y = data
        trainable, non_trainable, optimizer_variables, metrics = state

        def loss(trainable):
            y_pred, new = self.stateless_call(trainable, non_trainable, x, training=True)
            per_output = keras.ops.mean(keras.ops.square(y_pred - y), axis=0)
            return keras.ops.sum(per_output), (per_output, new)

        (total, (per_output, non_trainable)), grads = jax.value_and_grad(loss, has_aux=True)(
            trainable)
        trainable, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable)
        return ({"loss": per_output, "total": total},
                (trainable, non_trainable, optimizer_variables, metrics))


def _loss_per_output(steps_per_execution):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    model = LossPerOutput(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer=keras.optimizers.SGD(0.05), steps_per_execution=steps_per_execution)
    return model


@pytest.mark.parametrize("steps_per_execution", [1, 4])
def test_a_loss_logged_as_several_values_trains_and_is_guarded_as_keras_logs_it(
        steps_per_execution):
    # The non-finite guard took logs["loss"] for one number: a step logging
    # one loss per output failed in keras_dp's guard ("The shape of the
    # target variable ... must match. variable.shape=(), Received:
    # value.shape=(2,)"), where model.fit logs the vector each epoch.
    rng = np.random.default_rng(5)
    x = rng.normal(size=(45, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 2))).astype("float32")
    options = dict(batch_size=16, epochs=2, shuffle=False, verbose=0)
    reference = _loss_per_output(steps_per_execution)
    expected = reference.fit(x, y, **options).history
    ours = _loss_per_output(steps_per_execution)
    got = keras_dp.fit_sharded(ours, x, y, devices=devices(2), **options).history
    assert sorted(got) == sorted(expected) == ["loss", "total"]
    for key in expected:
        np.testing.assert_allclose(np.stack(got[key]), np.stack(expected[key]), rtol=1e-5)
    assert np.shape(got["loss"][0]) == (2,)
    assert_weights_close(ours, reference)
    # One value NaN (the second output's labels, from batch 1) stops training there.
    y[16:32, 1] = np.nan
    model = _loss_per_output(steps_per_execution)
    with pytest.raises(FloatingPointError, match=r"became \[[^]]*nan\] at epoch 1, batch 1 "):
        keras_dp.fit_sharded(model, x, y, devices=devices(2), **options)
