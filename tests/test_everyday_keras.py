"""A Keras user's everyday settings, each against Keras's own `model.fit`.

Callbacks that change the model or its optimizer during `fit`, compile
settings, and a model that Keras trained before keras_dp (or trains after
it). Each trains a tiny model on 3 simulated devices (40 or 42 rows in
batches of 7, so 3, 2 and 2 rows per device) and compares the History, every
weight (within 1e-5 of its variable's largest entry) and the optimizer's
iteration count with Keras's `model.fit` on one device from the same initial
weights.
"""

import functools

import keras
import numpy as np
import pytest

import keras_dp
from conftest import assert_close_to_scale, assert_weights_close
from conftest import StopAtBatch
from conftest import devices

BATCH = 7
FIT = dict(batch_size=BATCH, verbose=0, shuffle=False)


def rows(count=40, features=5, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(count, features)).astype("float32"), rng.integers(0, 3, count)


def classifier(optimizer=None, batch_norm=False, with_input=True, **compile_options):
    """A small compiled classifier of 5 features into 3 classes, seeded.

    `optimizer` is an optimizer, or a function that makes one: one object
    compiled into two models is refused (see the last test).
    """
    keras.utils.set_random_seed(0)
    layers = [keras.Input((5,))] if with_input else []
    layers.append(keras.layers.Dense(8, activation="relu"))
    if batch_norm:
        layers.append(keras.layers.BatchNormalization())
    model = keras.Sequential(layers + [keras.layers.Dense(3)])
    # SGD at 0.05: at 0.1 with momentum 0.9, BatchNormalization over 2- and
    # 3-row shards grows float32 rounding to 5e-5 of a kernel in 4 epochs
    # (1e-16 in float64: not a difference in what is computed).
    if callable(optimizer):
        optimizer = optimizer()
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], **compile_options)
    return model


def fit_both(make_model, x, y, runner="trainer", make_callbacks=list, **options):
    """Fit one model with Keras and one with keras_dp; return both, and their Histories."""
    options = dict(FIT, **options)
    keras_model, model = make_model(), make_model()
    keras_history = keras_model.fit(x, y, callbacks=make_callbacks(), **options)
    if runner == "trainer":
        history = keras_dp.ShardedTrainer(model, devices=devices(3)).fit(
            x, y, callbacks=make_callbacks(), **options)
    else:
        history = keras_dp.fit_sharded(model, x, y, callbacks=make_callbacks(),
                                       devices=devices(3), **options)
    return keras_model, keras_history, model, history


def assert_same_training(keras_model, keras_history, model, history):
    assert history.epoch == keras_history.epoch
    assert sorted(history.history) == sorted(keras_history.history)
    for name, values in keras_history.history.items():
        np.testing.assert_allclose(history.history[name], values, rtol=1e-5, err_msg=name)
    assert_weights_close(model, keras_model)
    assert int(model.optimizer.iterations) == int(keras_model.optimizer.iterations)


def assert_same_optimizer_state(model, keras_model):
    # A slot (momentum) is a sum of recent gradients, and a gradient, made of
    # differences of nearly equal terms, keeps less of its own scale than the
    # weights it moves: on an Intel Xeon one momentum entry was 1.2e-5 of its
    # variable's largest entry off after 24 steps, where every weight held 1e-5.
    for mine, theirs in zip(model.optimizer.variables, keras_model.optimizer.variables,
                            strict=True):
        assert_close_to_scale(np.asarray(mine), np.asarray(theirs), scale=1e-4,
                              err_msg=mine.path)


# -- Callbacks that change the model or the optimizer -------------------------

class RateAtBatchBegin(keras.callbacks.Callback):
    """Sets `optimizer.learning_rate` (by attribute) in every `on_train_batch_begin`,
    as a per-batch warmup does; records the batches it was called at."""

    def __init__(self, at=None):
        super().__init__()
        self.at, self.seen = at, []

    def on_train_batch_begin(self, batch, logs=None):
        self.seen.append(batch)
        if self.at is None or batch in self.at:
            self.model.optimizer.learning_rate = 0.02 * (batch + 1)


@pytest.mark.parametrize("runner", ["trainer", "fit_sharded"])
def test_a_rate_set_in_on_train_batch_begin_trains_that_step_as_under_keras(runner):
    x, y = rows()
    keras_model, keras_history, model, history = fit_both(
        classifier, x, y, runner=runner, make_callbacks=lambda: [RateAtBatchBegin()], epochs=2)
    assert_same_training(keras_model, keras_history, model, history)
    assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(0.12)  # batch 5's


def test_at_k_steps_a_rate_set_in_on_train_batch_begin_trains_the_call_it_begins():
    # The hook runs once per call and its rate trains the call's K steps, as
    # under Keras: with 6 full batches at K=2, the same training as Keras's.
    x, y = rows(42)
    two_per_call = functools.partial(classifier, steps_per_execution=2)
    keras_model, keras_history, model, history = fit_both(
        two_per_call, x, y, make_callbacks=lambda: [RateAtBatchBegin()], epochs=2)
    assert_same_training(keras_model, keras_history, model, history)
    # 5 full batches and a partial one: keras_dp runs the leftovers (batch 4
    # and the partial batch 5) as calls of one step each, and the hooks see
    # them as one group, as Keras's one call: the rate is set at batches 0,
    # 2 and 4, and batch 5 trains at batch 4's rate, as under Keras.
    x, y = rows(40)
    ours, theirs = RateAtBatchBegin(), RateAtBatchBegin()
    callbacks = [ours, theirs]  # Keras's fit takes its callback first
    keras_model, keras_history, model, history = fit_both(
        two_per_call, x, y, make_callbacks=lambda: [callbacks.pop()], epochs=2)
    assert_same_training(keras_model, keras_history, model, history)
    assert ours.seen == theirs.seen == [0, 2, 4] * 2
    assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(0.1)  # batch 4's


class ShrinksWeights(keras.callbacks.Callback):
    """`model.set_weights` (BatchNormalization's statistics included) at each
    epoch's end and before batch 3 of each epoch."""

    def _shrink(self):
        self.model.set_weights([w * 0.9 for w in self.model.get_weights()])

    def on_train_batch_begin(self, batch, logs=None):
        if batch == 3:
            self._shrink()

    def on_epoch_end(self, epoch, logs=None):
        self._shrink()


SLOW = pytest.mark.slow  # a few seconds each; the other case of the test runs by default


@pytest.mark.parametrize("steps_per_execution", [pytest.param(1, marks=SLOW), 3])
def test_set_weights_in_a_callback_is_trained_on_as_under_keras(steps_per_execution):
    x, y = rows()
    make = functools.partial(classifier, batch_norm=True,
                             steps_per_execution=steps_per_execution)
    assert_same_training(*fit_both(make, x, y, make_callbacks=lambda: [ShrinksWeights()],
                                   epochs=2))


@pytest.mark.parametrize("steps_per_execution", [pytest.param(1, marks=SLOW), 2])
def test_early_stopping_restores_the_best_weights_and_the_next_fit_goes_on_from_them(
        steps_per_execution):
    x, y = rows()

    def stop():  # val_loss falls by less than min_delta: epoch 0 stays best
        return [keras.callbacks.EarlyStopping(monitor="val_loss", patience=1, min_delta=10.0,
                                              restore_best_weights=True)]

    make = functools.partial(classifier, batch_norm=True,
                             steps_per_execution=steps_per_execution)
    keras_model, keras_history, model, history = fit_both(
        make, x, y, runner="fit_sharded", make_callbacks=stop, epochs=10,
        validation_data=(x[:9], y[:9]))
    assert history.epoch == [0, 1]
    assert_same_training(keras_model, keras_history, model, history)
    again = keras_dp.fit_sharded(model, x, y, epochs=2, devices=devices(3), **FIT)
    assert_same_training(keras_model, keras_model.fit(x, y, epochs=2, **FIT), model, again)
    assert int(model.optimizer.iterations) == 4 * 6
    assert_same_optimizer_state(model, keras_model)


# -- Models Keras trained before, or after ------------------------------------

@pytest.mark.parametrize("steps_per_execution", [1, pytest.param(2, marks=SLOW)])
def test_a_model_keras_trained_goes_on_under_keras_dp_and_back(steps_per_execution):
    # The optimizer's iteration count and slots (Adam's moments) go on from
    # Keras's fit, and Keras's next fit goes on from keras_dp's.
    x, y = rows()
    runs = []
    for fit in ("keras", "keras_dp"):
        model = classifier(keras.optimizers.Adam(1e-2), steps_per_execution=steps_per_execution)
        model.fit(x, y, epochs=1, **FIT)
        runner = model if fit == "keras" else keras_dp.ShardedTrainer(model, devices=devices(3))
        history = runner.fit(x, y, epochs=3, initial_epoch=1, **FIT)
        runs.append((model, history, model.fit(x, y, epochs=1, **FIT)))
    (keras_model, keras_history, keras_after), (model, history, after) = runs
    assert_same_training(keras_model, keras_history, model, history)
    assert_same_training(keras_model, keras_after, model, after)
    assert int(model.optimizer.iterations) == 4 * 6
    assert_same_optimizer_state(model, keras_model)


@pytest.mark.slow  # 3 s; tests/test_fit.py trains an unbuilt Sequential by default
def test_a_sequential_without_input_is_built_from_the_first_batch_and_saves(tmp_path):
    x, y = rows()
    make = functools.partial(classifier, with_input=False)
    keras_model, keras_history, model, history = fit_both(make, x, y, runner="fit_sharded",
                                                          epochs=2, validation_split=0.25)
    assert_same_training(keras_model, keras_history, model, history)
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert_close_to_scale(loaded.predict(x, verbose=0), keras_model.predict(x, verbose=0))
    assert int(loaded.optimizer.iterations) == 2 * 5  # 30 training rows: 5 batches


def test_an_optimizer_built_for_another_model_is_refused_naming_the_fix():
    # One optimizer object compiled into two models: Keras's model.fit trains
    # the second with the first one's Adam moments and step count (paired by
    # position, no word said). keras_dp said "The model's trainable variables
    # changed since its optimizer was built ... No longer trainable, with
    # slots: <the other model's variables>", pointing at `trainable`.
    x, y = rows()
    shared = keras.optimizers.Adam(1e-2)
    first, second = classifier(shared), classifier(shared)
    first.fit(x, y, epochs=1, **FIT)
    before = second.get_weights()
    with pytest.raises(ValueError) as raised:
        keras_dp.fit_sharded(second, x, y, epochs=1, devices=devices(3), **FIT)
    assert str(raised.value) == (
        f"The model's optimizer (Adam, {shared.name!r}) was built for another model's "
        f"variables ({first.weights[0].path}, {first.weights[1].path} and 2 more): one "
        "optimizer object was compiled into two models. Keras's model.fit would train this "
        "model with the other model's slots and its step count (iterations=6). Compile each "
        "model with an optimizer of its own, for example model.compile(optimizer="
        "keras.optimizers.Adam.from_config(other_optimizer.get_config()), loss=..., "
        "metrics=[...]) for a fresh copy of this one.")
    assert int(shared.iterations) == 6  # no step taken
    for left, right in zip(second.get_weights(), before, strict=True):
        np.testing.assert_array_equal(left, right)
    # The fix: a fresh copy trains as Keras's fit does.
    fresh = functools.partial(classifier, lambda: keras.optimizers.Adam.from_config(
        shared.get_config()))
    assert_same_training(*fit_both(fresh, x, y, epochs=1))


class RecompilesAt(keras.callbacks.Callback):
    """Calls `model.compile` (a new loss; the same or a new optimizer) after batch 2 of epoch 1."""

    def __init__(self, same_optimizer):
        super().__init__()
        self.same_optimizer, self.done = same_optimizer, False

    def on_train_batch_end(self, batch, logs=None):
        if batch == 2 and not self.done:
            self.done = True
            self.model.compile(
                optimizer=self.model.optimizer if self.same_optimizer else keras.optimizers.SGD(),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                ignore_class=0))


@pytest.mark.parametrize("same_optimizer", [True, False], ids=["same_optimizer", "new_optimizer"])
def test_a_callback_that_compiles_the_model_during_fit_is_refused_at_the_next_step(same_optimizer):
    # Keras's model.fit fails on it with "'NoneType' object is not callable".
    # keras_dp said "The training state cannot be read yet ... Call
    # trainer.build(batch) with one batch of data first (fit does this for
    # you)", and with the same optimizer first trained the rest of the epoch
    # on the old loss.
    x, y = rows()
    model = classifier(keras.optimizers.Adam(1e-2))
    with pytest.raises(ValueError) as raised:
        keras_dp.fit_sharded(model, x, y, epochs=2, callbacks=[RecompilesAt(same_optimizer)],
                             devices=devices(3), **FIT)
    assert str(raised.value) == (
        "The model was compiled again during fit (a callback called model.compile): its new "
        "optimizer, loss and metrics are not built, and the fit's compiled step holds the "
        "old ones. Keras's model.fit fails on this too (\"'NoneType' object is not "
        "callable\"). Compile between fits instead: fit(..., epochs=k), then "
        "model.compile(...), then fit(..., initial_epoch=k, epochs=n).")
    assert raised.value.__notes__ == [
        "keras_dp: the model holds the weights after 3 steps of epoch 1, the last step that "
        "completed."]
    assert raised.value.__cause__ is None and raised.value.__context__ is None  # no chain


def two_output_model(outputs):
    """Two 3-class outputs, `a` and `b`, as a list or a dict."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    a, b = keras.layers.Dense(3, name="a")(hidden), keras.layers.Dense(3, name="b")(hidden)
    return keras.Model(inputs, [a, b] if outputs == "list" else {"a": a, "b": b})


@pytest.mark.parametrize("outputs", [pytest.param("list", marks=pytest.mark.slow), "dict"])  # list: 4 s
def test_one_flat_list_of_metrics_for_two_outputs_is_refused_with_the_fix(outputs):
    # Keras 2 applied a list of metrics to every output; Keras 3 reads a list
    # as one entry per output, and with 3 for 2 outputs its fit fails inside
    # its build with "tuple arity mismatch; expected: 2, got: 3" (list
    # outputs) or "Expected an instance of dict ..." (dict outputs), as
    # keras_dp's did. (A list of exactly 2 is one metric per output, in both.)
    x, y = rows()
    labels = [y, y] if outputs == "list" else {"a": y, "b": y}
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model = two_output_model(outputs)
    model.compile("sgd", loss=[loss, loss] if outputs == "list" else {"a": loss, "b": loss},
                  weighted_metrics=["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(2),
                                    "sparse_categorical_crossentropy"])
    with pytest.raises(ValueError) as raised:
        keras_dp.fit_sharded(model, x, labels, epochs=1, devices=devices(3), **FIT)
    metrics = ("['accuracy', SparseTopKCategoricalAccuracy(...), "
               "'sparse_categorical_crossentropy']")
    assert str(raised.value) == (
        f"weighted_metrics={metrics} is one flat list for a model of 2 outputs (a, b): Keras 3 "
        "reads a list as one entry per output, so it needs 2. Give one list per output, "
        f"weighted_metrics=[{metrics}, {metrics}], or a dict by output name, "
        f"weighted_metrics={{'a': {metrics}, 'b': {metrics}}}. Keras's model.fit fails on "
        "this too, inside its build.")
    assert not model.optimizer.built  # refused before anything was built or trained
    # The fix, one list per output, trains as Keras's fit does.
    def per_output():
        model = two_output_model(outputs)
        model.compile(keras.optimizers.SGD(0.05),
                      loss=[loss, loss] if outputs == "list" else {"a": loss, "b": loss},
                      weighted_metrics=[["accuracy"], ["accuracy"]])
        return model

    keras_model, keras_history, model, history = fit_both(
        per_output, x, labels, sample_weight=np.linspace(0.5, 1.5, len(y)), epochs=2)
    assert_same_training(keras_model, keras_history, model, history)
    assert "b_accuracy" in history.history


def test_a_lambda_callbacks_closure_over_the_model_sees_and_changes_it_at_epoch_end():
    # keras.callbacks.LambdaCallback(on_epoch_end=lambda e, l: model.save(...))
    # holds the model in a closure, not `self.model`. Keras's fit writes its
    # state into the model before on_epoch_end and reads it back at the next
    # epoch's start; keras_dp wrote it back only when a callback looked
    # through `self.model`, so the closure saw the weights of the fit's start
    # (0.13 away in a kernel of largest entry 0.74 after epoch 1) and what it
    # set was overwritten.
    # So does on_test_end, in the validation (Keras writes back before it).
    x, y = rows()
    seen = {}

    def make_callbacks(model, name):
        seen[name] = []

        def look_and_shrink(*args):
            seen[name].append(model.get_weights())
            model.set_weights([w * 0.9 for w in model.get_weights()])

        return [keras.callbacks.LambdaCallback(on_epoch_end=look_and_shrink,
                                               on_test_end=look_and_shrink)]

    keras_model, model = classifier(), classifier()
    options = dict(FIT, epochs=2, validation_data=(x[:9], y[:9]))
    keras_history = keras_model.fit(x, y, callbacks=make_callbacks(keras_model, "keras"),
                                    **options)
    history = keras_dp.fit_sharded(model, x, y, callbacks=make_callbacks(model, "ours"),
                                   devices=devices(3), **options)
    assert len(seen["ours"]) == 4
    assert_same_training(keras_model, keras_history, model, history)
    for mine, theirs in zip(seen["ours"], seen["keras"], strict=True):
        for left, right in zip(mine, theirs, strict=True):
            assert_close_to_scale(left, right)


def test_the_state_is_written_back_each_epoch_only_for_callbacks_that_may_read_the_model():
    # The write-backs before validation and after it, at each epoch's end
    # (as Keras's fit syncs its state), are for callbacks that may read the
    # model; with only History and the progress bar there is one per epoch,
    # History's (it sets `model.history` in on_epoch_end), not two.
    from unittest import mock

    from keras_dp.core import live as state_lib

    x, y = np.random.default_rng(0).normal(size=(24, 4)).astype("float32"), np.zeros((24, 2))
    counts = {}
    for name, callbacks in (("logs only", []),
                            ("a lambda", [keras.callbacks.LambdaCallback()])):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="mse")
        with mock.patch.object(state_lib, "write_back", wraps=state_lib.write_back) as written:
            keras_dp.fit_sharded(model, x, y, batch_size=8, epochs=3, verbose=1,
                                 validation_data=(x, y), callbacks=callbacks,
                                 devices=devices(2))
        counts[name] = written.call_count
    assert counts == {"logs only": 3, "a lambda": 6}, counts


class SetStatisticsOnTestEnd(keras.callbacks.Callback):
    """Sets the BatchNormalization layer's moving mean in `on_test_end`, as a user might."""

    def on_test_end(self, logs=None):
        layer = next(layer for layer in self.model.layers
                     if isinstance(layer, keras.layers.BatchNormalization))
        layer.moving_mean.assign(np.full(layer.moving_mean.shape, 0.25, "float32"))


def test_a_statistic_a_callback_sets_in_on_test_end_is_kept_as_under_keras():
    # The test steps' non-trainable values replaced, after on_test_end, what
    # a callback set there (validation in fit, and evaluate): Keras gives
    # them to the model before on_test_end, so the callback's value stays.
    x, y = rows()
    keras_model, keras_history, model, history = fit_both(
        functools.partial(classifier, batch_norm=True), x, y, epochs=2,
        validation_data=(x[:20], y[:20]), make_callbacks=lambda: [SetStatisticsOnTestEnd()])
    assert_same_training(keras_model, keras_history, model, history)
    [mean] = [layer.moving_mean for layer in model.layers
              if isinstance(layer, keras.layers.BatchNormalization)]
    np.testing.assert_array_equal(np.asarray(mean), np.full(8, 0.25, "float32"))
    # Standalone evaluate: the model keeps the callback's value too, as Keras's does.
    mean.assign(np.zeros(8, "float32"))
    keras_dp.ShardedTrainer(model, devices=devices(3)).evaluate(
        x, y, batch_size=BATCH, verbose=0, callbacks=[SetStatisticsOnTestEnd()])
    np.testing.assert_array_equal(np.asarray(mean), np.full(8, 0.25, "float32"))


# -- Callbacks that stop evaluate or predict early ----------------------------

def test_a_callback_stops_evaluate_predict_and_validation_early_as_under_keras():
    # model.stop_evaluating and model.stop_predicting were ignored: evaluate
    # scored all 6 batches and predict returned all 40 rows where Keras's
    # stop after batch 1 (2 batches, 14 rows), and fit's validation too.
    x, y = rows()
    stop = lambda: [StopAtBatch("stop_evaluating")]  # noqa: E731
    keras_model, keras_history, model, history = fit_both(
        classifier, x, y, epochs=2, validation_data=(x, y), make_callbacks=stop)
    assert_same_training(keras_model, keras_history, model, history)
    trainer = keras_dp.ShardedTrainer(model, devices=devices(3))
    theirs = keras_model.evaluate(x, y, batch_size=BATCH, verbose=0, callbacks=stop())
    ours = trainer.evaluate(x, y, batch_size=BATCH, verbose=0, callbacks=stop())
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    # The flag stays set, and the next call clears it at its start, as Keras's does.
    assert model.stop_evaluating and keras_model.stop_evaluating
    whole = keras_model.evaluate(x, y, batch_size=BATCH, verbose=0)
    assert whole != theirs  # the first stopped
    np.testing.assert_allclose(trainer.evaluate(x, y, batch_size=BATCH, verbose=0), whole,
                               rtol=1e-5)
    predicted = trainer.predict(x, batch_size=BATCH, verbose=0,
                                callbacks=[StopAtBatch("stop_predicting")])
    assert predicted.shape == (2 * BATCH, 3)
    assert_close_to_scale(predicted, keras_model.predict(
        x, batch_size=BATCH, verbose=0, callbacks=[StopAtBatch("stop_predicting")]))
    assert trainer.predict(x, batch_size=BATCH, verbose=0).shape == (40, 3)
