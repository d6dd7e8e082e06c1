"""Keras callbacks keep their `model.fit` meaning under `fit_sharded`.

Most tests run the same callback under Keras's own `model.fit` (one device)
and under keras_dp (2 simulated devices) from the same initial weights, and
assert equal results; the others assert the callback's effect directly.
"""

import csv
import functools

import keras
import numpy as np
import pytest

import keras_dp
import conftest
from keras_dp import distributed
from conftest import assert_close_to_scale, assert_weights_close
from conftest import devices
from conftest import weights

ROWS, BATCH = 512, 64  # 8 steps per epoch


sgd_mlp = functools.partial(conftest.sgd_mlp, momentum=0.9)


@pytest.fixture
def data(mnist):
    (x, y), (x_test, y_test) = mnist
    return x[:ROWS], y[:ROWS], (x_test[:256], y_test[:256])


def keras_and_sharded(data, make_callbacks, epochs=2, **fit_kwargs):
    """Train two copies of one model, by Keras and by keras_dp; return both."""
    x, y, val = data
    results = []
    for fit in ("keras", "sharded"):
        model = sgd_mlp()
        kwargs = dict(batch_size=BATCH, epochs=epochs, verbose=0, shuffle=False,
                      validation_data=val, callbacks=make_callbacks(), **fit_kwargs)
        if fit == "keras":
            history = model.fit(x, y, **kwargs)
        else:
            trainer = keras_dp.ShardedTrainer(model, devices=devices(2))
            history = trainer.fit(x, y, **kwargs)
        results.append((model, history, kwargs["callbacks"]))
    return results


class ReadsMidEpoch(keras.callbacks.Callback):
    """Records the model's weights after batch 2 of every epoch."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        if batch == 2:
            self.seen.append(weights(self.model))


class HalvesKernelMidEpoch(keras.callbacks.Callback):
    """Halves the last layer's kernel before batch 3 of every epoch."""

    def on_train_batch_begin(self, batch, logs=None):
        if batch == 3:
            kernel = self.model.layers[-1].kernel
            kernel.assign(kernel.numpy() * 0.5)


def test_a_callback_reads_current_weights_mid_epoch(data):
    (_, _, (keras_cb,)), (_, _, (ours,)) = keras_and_sharded(data, lambda: [ReadsMidEpoch()])
    assert len(ours.seen) == 2
    for keras_seen, seen in zip(keras_cb.seen, ours.seen, strict=True):
        for left, right in zip(keras_seen, seen, strict=True):
            assert_close_to_scale(right, left)
    # Not the epoch-start weights: three steps have been taken.
    assert not np.allclose(ours.seen[1][-1], ours.seen[0][-1])


def test_a_callbacks_change_mid_epoch_is_trained_on(data):
    (keras_model, _, _), (model, _, _) = keras_and_sharded(data, lambda: [HalvesKernelMidEpoch()])
    assert_weights_close(model, keras_model)
    untouched = sgd_mlp()
    keras_dp.fit_sharded(untouched, data[0], data[1], batch_size=BATCH, epochs=2, verbose=0,
                         shuffle=False, devices=devices(2))
    assert not np.allclose(weights(untouched)[-2], weights(model)[-2], rtol=1e-2)


class HalvesKernelAtEpochEnd(keras.callbacks.Callback):
    """Halves the last layer's kernel at the end of every epoch."""

    def on_epoch_end(self, epoch, logs=None):
        kernel = self.model.layers[-1].kernel
        kernel.assign(kernel.numpy() * 0.5)


def test_a_change_between_epochs_is_trained_on_and_the_last_one_kept(data):
    # The state stays on the devices between epochs unless the model changed:
    # this change must be seen, and the one after the last epoch not undone.
    (keras_model, _, _), (model, _, _) = keras_and_sharded(
        data, lambda: [HalvesKernelAtEpochEnd()], epochs=3)
    assert_weights_close(model, keras_model)


class PredictsAndEvaluates(keras.callbacks.Callback):
    """Calls Keras's own `predict` and `evaluate` on `self.model` at every epoch end."""

    def __init__(self, x, y):
        super().__init__()
        self.x, self.y, self.seen = x, y, []

    def on_epoch_end(self, epoch, logs=None):
        outputs = self.model.predict(self.x, verbose=0)
        self.seen.append((outputs, self.model.evaluate(self.x, self.y, verbose=0)))


def test_a_callback_may_call_model_predict_and_evaluate(data):
    # Keras's predict and evaluate empty the model's variables while they run
    # and refill them through `jax_state_sync`, which keras_dp shadows in fit.
    x, y, _ = data
    (keras_model, _, (keras_cb,)), (model, _, (ours,)) = keras_and_sharded(
        data, lambda: [PredictsAndEvaluates(x[:100], y[:100])])
    assert len(ours.seen) == 2
    for (keras_outputs, keras_logs), (outputs, logs) in zip(keras_cb.seen, ours.seen, strict=True):
        assert_close_to_scale(outputs, keras_outputs)
        np.testing.assert_allclose(logs, keras_logs, rtol=1e-5)
    assert_weights_close(model, keras_model)


def test_callbacks_that_do_not_look_cost_no_copies(data, tmp_path, monkeypatch):
    # A per-step write-back would cost a device-to-host copy of every
    # variable per step: the standard callbacks must not cause one.
    x, y, val = data
    model = sgd_mlp()
    trainer = keras_dp.ShardedTrainer(model, devices=devices(2))
    reads = []
    original = trainer.init_state
    monkeypatch.setattr(trainer, "init_state", lambda: reads.append(1) or original())
    callbacks = [
        keras.callbacks.ModelCheckpoint(str(tmp_path / "m.keras")),
        keras.callbacks.CSVLogger(str(tmp_path / "log.csv")),
        keras.callbacks.EarlyStopping(monitor="val_loss", patience=5),
        keras.callbacks.TerminateOnNaN(),
        keras.callbacks.ReduceLROnPlateau(monitor="loss", patience=5),
    ]
    trainer.fit(x, y, batch_size=BATCH, epochs=3, verbose=1, validation_data=val,
                callbacks=callbacks)
    # One read at the start: these callbacks look at the model every epoch
    # (each look writes the state back) but change nothing, so the state
    # stays on the devices from epoch to epoch.
    assert len(reads) == 1


def test_learning_rate_scheduler_reaches_the_step_without_a_recompile(data):
    schedule = lambda epoch, lr: 0.05 * 0.5**epoch  # noqa: E731
    (keras_model, _, _), (model, history, _) = keras_and_sharded(
        data, lambda: [keras.callbacks.LearningRateScheduler(schedule)], epochs=3
    )
    assert_weights_close(model, keras_model)
    assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(0.0125)
    np.testing.assert_allclose(history.history["learning_rate"], [0.05, 0.025, 0.0125])


def test_reduce_lr_on_plateau_and_a_mid_epoch_rate_change_without_recompile(data):
    x, y, _ = data
    model = sgd_mlp(momentum=0.0)  # so that a zero rate means no update at all
    trainer = keras_dp.ShardedTrainer(model, devices=devices(2))

    class FreezeAfterBatch3(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 3:
                self.after_3 = weights(self.model)
                self.model.optimizer.learning_rate = 0.0

    freeze = FreezeAfterBatch3()
    # min_delta larger than any improvement: after epoch 0 sets the best, the
    # rate halves at the end of every epoch.
    plateau = keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0,
                                                min_delta=100.0, min_lr=0.0)
    trainer.fit(x, y, batch_size=BATCH, epochs=3, verbose=0, callbacks=[plateau])
    assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(0.05 * 0.25)
    trainer.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[freeze])
    # With rate 0 from batch 4 on, SGD leaves the weights where batch 3 left them.
    for left, right in zip(freeze.after_3, weights(model), strict=True):
        np.testing.assert_array_equal(left, right)
    assert trainer.programs.resident_step._cache_size() == 1  # the arrays train on the devices


def test_model_checkpoint_weights_and_best_full_model(data, tmp_path):
    x, y, val = data
    model = sgd_mlp()

    class EpochWeights(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.by_epoch = []

        def on_epoch_end(self, epoch, logs=None):
            self.by_epoch.append((logs["val_loss"], weights(self.model)))

    record = EpochWeights()
    callbacks = [
        keras.callbacks.ModelCheckpoint(str(tmp_path / "w-{epoch}.weights.h5"),
                                        save_weights_only=True),
        keras.callbacks.ModelCheckpoint(str(tmp_path / "best.keras"), monitor="val_loss",
                                        save_best_only=True),
        record,
    ]
    keras_dp.fit_sharded(model, x, y, batch_size=BATCH, epochs=3, verbose=0,
                         validation_data=val, callbacks=callbacks, devices=devices(2))
    assert sorted(p.name for p in tmp_path.glob("w-*")) == [f"w-{e}.weights.h5" for e in (1, 2, 3)]
    restored = sgd_mlp(seed=1)
    restored.load_weights(str(tmp_path / "w-3.weights.h5"))
    for left, right in zip(weights(restored), weights(model), strict=True):
        np.testing.assert_array_equal(left, right)
    best_loss, best_weights = min(record.by_epoch, key=lambda item: item[0])
    best = keras.saving.load_model(str(tmp_path / "best.keras"))
    for left, right in zip(weights(best), best_weights, strict=True):
        np.testing.assert_array_equal(left, right)


def test_early_stopping_restores_the_best_epochs_weights(data):
    x, y, _ = data

    class EpochWeights(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            self.first = getattr(self, "first", None) or weights(self.model)

    record = EpochWeights()
    # The loss falls, so with mode="max" epoch 0 stays best and patience 1
    # stops after epoch 1.
    stop = keras.callbacks.EarlyStopping(monitor="loss", mode="max", patience=1,
                                         restore_best_weights=True)
    model = sgd_mlp()
    history = keras_dp.fit_sharded(model, x, y, batch_size=BATCH, epochs=10, verbose=0,
                                   callbacks=[record, stop], devices=devices(2))
    assert len(history.history["loss"]) == 2
    assert stop.stopped_epoch == 1
    for left, right in zip(weights(model), record.first, strict=True):
        np.testing.assert_array_equal(left, right)


def test_csv_logger_tensorboard_and_progress_bar(data, tmp_path, capsys):
    x, y, val = data
    callbacks = [
        keras.callbacks.CSVLogger(str(tmp_path / "log.csv")),
        keras.callbacks.TensorBoard(str(tmp_path / "tb")),
    ]
    history = keras_dp.fit_sharded(sgd_mlp(), x, y, batch_size=BATCH, epochs=2, verbose=1,
                                   validation_data=val, callbacks=callbacks, devices=devices(2))
    with open(tmp_path / "log.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [int(row["epoch"]) for row in rows] == [0, 1]
    np.testing.assert_allclose([float(row["loss"]) for row in rows], history.history["loss"],
                               rtol=1e-6)
    events = list((tmp_path / "tb").rglob("events.out.tfevents.*"))
    assert {path.parent.name for path in events} == {"train", "validation"}
    assert all(path.stat().st_size > 0 for path in events)
    out = capsys.readouterr().out
    assert "Epoch 1/2" in out and "Epoch 2/2" in out and "8/8" in out


def test_backup_and_restore_resumes_at_the_interrupted_epoch(data, tmp_path):
    x, y, _ = data

    class CrashAtEpoch2(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 2:
                raise RuntimeError("simulated crash")

    backup = str(tmp_path / "backup")
    model = sgd_mlp()
    kwargs = dict(batch_size=BATCH, epochs=4, verbose=0, shuffle=False, devices=devices(2))
    with pytest.raises(RuntimeError, match="simulated crash"):
        keras_dp.fit_sharded(model, x, y, callbacks=[keras.callbacks.BackupAndRestore(backup),
                                                     CrashAtEpoch2()], **kwargs)
    resumed = sgd_mlp(seed=1)  # other initial weights: the backup replaces them
    history = keras_dp.fit_sharded(resumed, x, y,
                                   callbacks=[keras.callbacks.BackupAndRestore(backup)], **kwargs)
    assert history.epoch == [2, 3]
    unbroken = sgd_mlp()
    keras_dp.fit_sharded(unbroken, x, y, **kwargs)
    assert_weights_close(resumed, unbroken)
    # The restored epoch applies to that fit only (Keras would keep it).
    assert keras_dp.fit_sharded(resumed, x, y, **dict(kwargs, epochs=1)).epoch == [0]


def test_kerass_callbacks_announce_their_decisions_on_process_0_only(monkeypatch, capsys):
    # Under `keras-dp launch` every process printed "Epoch 2: early stopping"
    # and the learning-rate messages, where the progress bar is process 0's
    # alone. Process 1 (`is_primary()` False here) now runs them silent and
    # decides the same; their `verbose` is theirs again after the fit.
    rng = np.random.default_rng(0)
    x, y = rng.random((16, 28, 28, 1), "float32"), rng.integers(0, 10, 16)
    runs = {}
    for primary in (True, False):
        monkeypatch.setattr(distributed, "is_primary", lambda primary=primary: primary)
        callbacks = [
            keras.callbacks.EarlyStopping(monitor="loss", min_delta=10, patience=1, verbose=1),
            keras.callbacks.ReduceLROnPlateau(monitor="loss", min_delta=10, patience=0,
                                              verbose=1),
            keras.callbacks.LearningRateScheduler(lambda epoch, rate: rate, verbose=2)]
        history = keras_dp.fit_sharded(conftest.mlp(), x, y, batch_size=8, epochs=5,
                                       shuffle=False, callbacks=callbacks, devices=devices(2))
        runs[primary] = history.history, capsys.readouterr().out
        assert [callback.verbose for callback in callbacks] == [1, 1, 2]
    (shown, out), (silent, quiet) = runs[True], runs[False]
    for message in ("Epoch 2: early stopping", "Epoch 2: ReduceLROnPlateau reducing",
                    "Epoch 1: LearningRateScheduler setting learning rate", "Epoch 2/5"):
        assert message in out, out
    assert quiet == ""
    assert list(silent) == list(shown) and silent["loss"] == shown["loss"]


def test_an_item_of_callbacks_that_is_not_a_callback_is_named():
    # Keras fails with "'str' object has no attribute 'on_batch_end'".
    x, y = np.zeros((16, 28, 28, 1), "float32"), np.zeros(16, "int32")
    for bad in ["early_stopping", None]:
        with pytest.raises(TypeError) as error:
            keras_dp.fit_sharded(conftest.mlp(), x, y, batch_size=8, verbose=0, devices=devices(2),
                                 callbacks=[keras.callbacks.History(), bad])
        assert str(error.value) == (
            "`callbacks` takes keras.callbacks.Callback objects, such as "
            "keras.callbacks.EarlyStopping(patience=2). Received at index 1: "
            f"{bad!r} (of type {type(bad).__name__}).")


@pytest.mark.parametrize("hook", ["on_train_batch_end", "on_epoch_begin"])
def test_a_callback_that_changes_trainable_mid_fit_is_refused_and_the_model_keeps_its_steps(hook):
    # Keras's model.fit fails on this with a shape mismatch as it syncs its
    # state back, leaving variables it cannot read; keras_dp wrote the state
    # back into the regrouped variables, failed alike (or with Keras's
    # "optimizer_variables must be ... 1:1") and lost every step of the fit.
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 8)).astype("float32"), rng.integers(0, 3, 32)

    def model_and_base():
        keras.utils.set_random_seed(1)
        base = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, name="b")])
        inputs = keras.Input((8,))
        model = keras.Model(inputs, keras.layers.Dense(3)(base(inputs)))
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model, base

    class Freeze(keras.callbacks.Callback):
        def __init__(self, base):
            super().__init__()
            self.base = base

        def on_train_batch_end(self, batch, logs=None):
            if hook == "on_train_batch_end" and batch == 1:
                self.base.trainable = False

        def on_epoch_begin(self, epoch, logs=None):
            if hook == "on_epoch_begin" and epoch == 1:
                self.base.trainable = False

    one_epoch, _ = model_and_base()
    fit = functools.partial(keras_dp.fit_sharded, batch_size=8, shuffle=False, verbose=0,
                            devices=devices(2))
    fit(one_epoch, x, y, epochs=1)
    model, base = model_and_base()
    with pytest.raises(ValueError, match=r"^The model's trainable variables changed since its "
                       r"optimizer was built: 2 are trainable now, the optimizer holds slots "
                       r"for 4\. A layer's `trainable` set after training \(or during it, in a "
                       r"callback\)") as error:
        fit(model, x, y, epochs=3, callbacks=[Freeze(base)])
    assert error.value.__notes__[-1] == (
        "keras_dp: the model holds the weights after 4 steps of epoch 1, the last step that "
        "completed.")
    assert int(model.optimizer.iterations) == 4
    for left, right in zip(weights(model), weights(one_epoch), strict=True):
        np.testing.assert_array_equal(left, right)


class RecordsParams(keras.callbacks.Callback):
    """Records `self.params` at the start of each fit, evaluate and predict."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_begin(self, logs=None):
        self.seen.append(("fit", dict(self.params)))

    def on_test_begin(self, logs=None):
        self.seen.append(("evaluate", dict(self.params)))

    def on_predict_begin(self, logs=None):
        self.seen.append(("predict", dict(self.params)))


def test_evaluate_and_predict_keep_the_fits_history_and_params_are_keras(data, capsys):
    # Before: evaluate and predict added a History of their own, so after
    # `fit; evaluate` model.history was an empty History; their params
    # lacked epochs=1, fit's said verbose=1 for "auto", and evaluate's
    # return_dict put loss before accuracy (Keras sorts logs by name).
    x, y, (x_val, y_val) = data
    results = []
    for fit in ("keras", "sharded"):
        model, record = sgd_mlp(), RecordsParams()
        runner = model if fit == "keras" else keras_dp.ShardedTrainer(model, devices=devices(2))
        history = runner.fit(x[:128], y[:128], batch_size=BATCH, epochs=2, verbose="auto",
                             shuffle=False, callbacks=[record])
        scores = runner.evaluate(x_val, y_val, batch_size=BATCH, verbose=0, return_dict=True,
                                 callbacks=[record])
        runner.predict(x_val[:10], verbose=0, callbacks=[record])
        assert model.history is history
        assert history.epoch == [0, 1] and len(history.history["loss"]) == 2
        results.append((record.seen, history.params, scores))
    (keras_seen, keras_params, keras_scores), (seen, params, scores) = results
    assert seen == keras_seen == [
        ("fit", {"verbose": "auto", "epochs": 2, "steps": 2}),
        ("evaluate", {"verbose": 0, "epochs": 1, "steps": 4}),
        ("predict", {"verbose": 0, "epochs": 1, "steps": 1})]
    assert params == keras_params
    assert list(scores) == list(keras_scores) == ["accuracy", "loss"]
    np.testing.assert_allclose(list(scores.values()), list(keras_scores.values()), rtol=1e-5)
    capsys.readouterr()


class ChangesRateThenStops(keras.callbacks.Callback):
    """Sets the rate to 0.2 after batch 1 and stops after batch 5; records the batch ends."""

    def __init__(self):
        super().__init__()
        self.ends = []

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append((batch, logs["loss"]))
        if batch == 1:
            self.model.optimizer.learning_rate.assign(0.2)
        if batch == 5:
            self.model.stop_training = True


def test_a_rate_change_and_a_stop_mid_epoch_act_per_k_step_call_as_under_keras(data):
    # At steps_per_execution=2, Keras calls the batch hooks once per call
    # (batches 1, 3, 5): the new rate trains from batch 2, the first step of
    # the next call, and the stop after batch 5 ends the epoch there.
    x, y, _ = data
    results = []
    for fit in ("keras", "sharded"):
        model, record = sgd_mlp(), ChangesRateThenStops()
        model.compile(optimizer=model.optimizer, loss=model.loss, metrics=["accuracy"],
                      steps_per_execution=2)
        runner = model if fit == "keras" else keras_dp.ShardedTrainer(model, devices=devices(2))
        history = runner.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False,
                             callbacks=[record])
        results.append((model, history, record))
    (keras_model, keras_history, keras_record), (model, history, record) = results
    assert [batch for batch, _ in record.ends] == [batch for batch, _ in keras_record.ends] \
        == [1, 3, 5]
    np.testing.assert_allclose([loss for _, loss in record.ends],
                               [loss for _, loss in keras_record.ends], rtol=1e-5)
    assert history.epoch == keras_history.epoch == [0]
    np.testing.assert_allclose(history.history["loss"], keras_history.history["loss"], rtol=1e-5)
    assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(0.2)
    assert int(model.optimizer.iterations.numpy()) == 6
    assert_weights_close(model, keras_model)


class HalvesKernelAtLastBatch(keras.callbacks.Callback):
    """Halves the last layer's kernel at the end of each epoch's last batch."""

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.params["steps"] - 1:
            kernel = self.model.layers[-1].kernel
            kernel.assign(kernel.numpy() * 0.5)


class ScoresHalvedKernel(keras.callbacks.Callback):
    """Halves the last layer's kernel while evaluating or predicting, as
    `SwapEMAWeights` swaps the averages in and out."""

    def _halve(self, logs=None):
        kernel = self.model.layers[-1].kernel
        self.kept = kernel.numpy()
        kernel.assign(self.kept * 0.5)

    def _restore(self, logs=None):
        self.model.layers[-1].kernel.assign(self.kept)

    on_test_begin = on_predict_begin = _halve
    on_test_end = on_predict_end = _restore


def test_what_callbacks_change_around_validation_is_scored_and_trained_on_as_under_keras(data):
    # Before: validation scored the weights of the last step, ignoring a
    # change at the last batch's end or in on_test_begin, and the epoch's
    # end wrote them back over the model, so the last batch's change was
    # lost (epoch 2's loss 1.39 against Keras's 1.69).
    x, y, (x_val, y_val) = data
    results = []
    for fit in ("keras", "sharded"):
        model = sgd_mlp()
        runner = model if fit == "keras" else keras_dp.ShardedTrainer(model, devices=devices(2))
        history = runner.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False,
                             validation_data=(x_val, y_val),
                             callbacks=[HalvesKernelAtLastBatch(), ScoresHalvedKernel()])
        scores = runner.evaluate(x_val, y_val, batch_size=BATCH, verbose=0,
                                 callbacks=[ScoresHalvedKernel()])
        outputs = runner.predict(x_val[:100], batch_size=BATCH, verbose=0,
                                 callbacks=[ScoresHalvedKernel()])
        results.append((model, history.history, scores, outputs))
    (keras_model, keras_history, keras_scores, keras_outputs), (model, history, scores,
                                                                outputs) = results
    for name in ("loss", "val_loss", "val_accuracy"):
        np.testing.assert_allclose(history[name], keras_history[name], rtol=1e-5)
    np.testing.assert_allclose(scores, keras_scores, rtol=1e-5)
    assert_close_to_scale(outputs, keras_outputs)
    assert_weights_close(model, keras_model)


def test_swap_ema_weights_validates_with_the_moving_averages_as_under_keras(data):
    x, y, val = data
    histories = []
    for fit in ("keras", "sharded"):
        model = sgd_mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.05, use_ema=True, ema_momentum=0.9),
                      loss=model.loss, metrics=["accuracy"])
        runner = model if fit == "keras" else keras_dp.ShardedTrainer(model, devices=devices(2))
        histories.append(runner.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False,
                                    validation_data=val,
                                    callbacks=[keras.callbacks.SwapEMAWeights()]).history)
        histories[-1]["weights"] = weights(model)
    keras_history, history = histories
    for name in ("loss", "val_loss"):  # val_loss was 2.15 after epoch 1, Keras's 2.26
        np.testing.assert_allclose(history[name], keras_history[name], rtol=1e-5)
    for mine, theirs in zip(history["weights"], keras_history["weights"], strict=True):
        assert_close_to_scale(mine, theirs)


@pytest.mark.parametrize("make_callback", [
    lambda: keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.05 * 0.5**epoch),
    # min_delta larger than any improvement: the rate halves after every epoch.
    lambda: keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0,
                                              min_delta=100.0, min_lr=0.0),
], ids=["scheduler", "plateau"])
def test_rate_callbacks_equal_keras_and_the_step_compiles_once(data, make_callback):
    # README: ReduceLROnPlateau and LearningRateScheduler equal Keras, and a
    # new rate reaches the compiled step with no recompile.
    x, y, val = data
    results = []
    for fit in ("keras", "sharded"):
        model = sgd_mlp()
        runner = model if fit == "keras" else keras_dp.ShardedTrainer(model, devices=devices(2))
        history = runner.fit(x, y, batch_size=BATCH, epochs=3, verbose=0, shuffle=False,
                             validation_data=val, callbacks=[make_callback()])
        results.append((model, history.history, runner))
    (keras_model, keras_history, _), (model, history, trainer) = results
    np.testing.assert_allclose(history["learning_rate"], keras_history["learning_rate"])
    assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(0.0125)
    for name in ("loss", "val_loss"):
        np.testing.assert_allclose(history[name], keras_history[name], rtol=1e-5)
    assert_weights_close(model, keras_model)
    programs = trainer.programs.resident_step._cache_size() + trainer.programs.train_step._cache_size()
    assert programs == 1  # 8 full batches per epoch: one program, for every rate


class CrashesAt(keras.callbacks.Callback):
    """Raises at the end of the call that ends at `batch` of `epoch` (or after)."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.at, self.epoch = (epoch, batch), None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) >= self.at:
            raise RuntimeError("simulated crash")


def test_backups_and_checkpoints_every_n_batches_at_k_steps_resume_as_under_keras(data, tmp_path):
    # At steps_per_execution=4, save_freq=3 counts batches from the hooks'
    # indices (3, 7), so both save after every call, as Keras's do. Keras's
    # BackupAndRestore resumes a backup taken mid-epoch at the start of that
    # epoch, from the weights of the batch it saved (not as an unbroken
    # run): keras_dp's fit does the same, with the same files written.
    x, y, _ = data
    results = []
    for fit in ("keras", "sharded"):
        backup, saved = tmp_path / fit / "backup", tmp_path / fit / "saved"
        kwargs = dict(batch_size=BATCH, epochs=3, verbose=0, shuffle=False)
        histories = []
        for seed, crash in ((0, [CrashesAt(1, 3)]), (1, [])):  # the rerun's weights are replaced
            model = sgd_mlp(seed)
            model.compile(optimizer=model.optimizer, loss=model.loss, metrics=["accuracy"],
                          steps_per_execution=4)
            runner = model if fit == "keras" else keras_dp.ShardedTrainer(model, devices=devices(2))
            callbacks = [keras.callbacks.BackupAndRestore(str(backup), save_freq=3,
                                                          double_checkpoint=True,
                                                          delete_checkpoint=False),
                         keras.callbacks.ModelCheckpoint(str(saved / "{epoch}-{batch}.weights.h5"),
                                                         save_weights_only=True, save_freq=3)]
            try:
                histories.append(runner.fit(x, y, callbacks=callbacks + crash, **kwargs))
            except RuntimeError as error:
                assert str(error) == "simulated crash"
                metadata = (backup / "training_metadata.json").read_text()
        files = sorted(path.name for path in saved.iterdir())
        results.append((model, histories[0], metadata, files))
    (keras_model, keras_history, keras_metadata, keras_files), (model, history, metadata,
                                                                  files) = results
    assert metadata == keras_metadata == '{"epoch": 1, "batch": 3}'
    assert files == keras_files == ["1-4.weights.h5", "1-8.weights.h5", "2-4.weights.h5",
                                    "2-8.weights.h5", "3-4.weights.h5", "3-8.weights.h5"]
    assert history.epoch == keras_history.epoch == [1, 2]
    np.testing.assert_allclose(history.history["loss"], keras_history.history["loss"], rtol=1e-5)
    assert_weights_close(model, keras_model)
