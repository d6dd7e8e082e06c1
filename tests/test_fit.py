"""fit_sharded as a Keras user meets it: data kinds, callbacks, write-back."""

import os

import jax
import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dp
from conftest import SubclassedClassifier, assert_close_to_scale, convnet, devices, mlp, weights


def test_fit_sharded_trains_mnist_and_returns_history(mnist):
    (x, y), (x_test, y_test) = mnist
    model = convnet()
    history = keras_dp.fit_sharded(
        model, x, y, epochs=2, batch_size=64, verbose=0,
        validation_data=(x_test, y_test), devices=devices(2),
    )
    assert isinstance(history, keras.callbacks.History)
    assert history.epoch == [0, 1]
    assert set(history.history) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    assert history.history["loss"][1] < history.history["loss"][0]
    assert history.history["accuracy"][1] > 0.45  # measured 0.54 after 2 epochs of 2,048
    assert model.history is history


def test_model_predict_equals_trainer_predict_and_keras_file_round_trips(mnist, tmp_path):
    (x, y), (x_test, _) = mnist
    model = convnet()
    keras_dp.fit_sharded(model, x[:512], y[:512], batch_size=64, verbose=0, devices=devices(4))
    trainer = keras_dp.ShardedTrainer(model, devices=devices(4))
    sharded = trainer.predict(x_test[:300], batch_size=64, verbose=0)  # last batch: 44 rows
    assert sharded.shape == (300, 10)
    assert_close_to_scale(model.predict(x_test[:300], verbose=0), sharded)
    model.save(tmp_path / "convnet.keras")
    loaded = keras.models.load_model(tmp_path / "convnet.keras")
    assert_close_to_scale(loaded.predict(x_test[:300], verbose=0), sharded)


def test_evaluate_matches_keras_evaluate(mnist):
    (x, y), (x_test, y_test) = mnist
    model = mlp()
    keras_dp.fit_sharded(model, x[:512], y[:512], batch_size=64, verbose=0, devices=devices(2))
    ours = keras_dp.ShardedTrainer(model, devices=devices(8)).evaluate(
        x_test, y_test, batch_size=128, verbose=0, return_dict=True)
    theirs = model.evaluate(x_test, y_test, batch_size=128, verbose=0, return_dict=True)
    assert list(ours) == list(theirs) == ["accuracy", "loss"]  # Keras sorts logs by name
    np.testing.assert_allclose(ours["loss"], theirs["loss"], rtol=1e-5)
    np.testing.assert_allclose(ours["accuracy"], theirs["accuracy"], rtol=1e-6)


@pytest.mark.parametrize("kind", ["tuple", "sample_weight", "tf.data", "list", "generator",
                                  "jax.Array", "tf.Tensor"])
def test_every_input_kind_gives_the_same_training(mnist, kind):
    (x, y), _ = mnist
    x, y = x[:256], y[:256]
    reference = mlp()
    keras_dp.fit_sharded(reference, x, y, batch_size=64, shuffle=False, verbose=0, devices=devices(2))
    batches = [(x[i:i + 64], y[i:i + 64]) for i in range(0, 256, 64)]
    data = {
        "tuple": (x, y),
        "sample_weight": (x, y, np.ones(256, np.float32)),
        "tf.data": tf.data.Dataset.from_tensor_slices((x, y)).batch(64),
        "list": batches,
        "generator": (batch for batch in batches),
        "jax.Array": (jax.numpy.asarray(x), jax.numpy.asarray(y)),
        "tf.Tensor": (tf.constant(x), tf.constant(y)),
    }[kind]
    model = mlp()
    batch_size = 64 if kind in ("tuple", "sample_weight", "jax.Array", "tf.Tensor") else None
    keras_dp.fit_sharded(model, data, batch_size=batch_size, shuffle=False, verbose=0, devices=devices(2))
    for a, b in zip(weights(reference), weights(model)):
        assert_close_to_scale(b, a)


def test_callbacks_see_the_model_fit_hooks(mnist):
    (x, y), (x_test, y_test) = mnist
    calls = []

    class Record(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            calls.append("train_begin")

        def on_epoch_begin(self, epoch, logs=None):
            calls.append(f"epoch_begin {epoch}")

        def on_train_batch_end(self, batch, logs=None):
            calls.append("batch")
            assert "loss" in logs

        def on_test_end(self, logs=None):
            calls.append("test_end")

        def on_epoch_end(self, epoch, logs=None):
            calls.append(f"epoch_end {epoch} {sorted(logs)}")

        def on_train_end(self, logs=None):
            calls.append("train_end")

    keras_dp.fit_sharded(mlp(), x[:256], y[:256], batch_size=64, epochs=2, verbose=0,
                         validation_data=(x_test[:128], y_test[:128]),
                         callbacks=[Record()], devices=devices(2))
    epoch_end = "['accuracy', 'loss', 'val_accuracy', 'val_loss']"
    assert calls == (
        ["train_begin"]
        + ["epoch_begin 0"] + ["batch"] * 4 + ["test_end", f"epoch_end 0 {epoch_end}"]
        + ["epoch_begin 1"] + ["batch"] * 4 + ["test_end", f"epoch_end 1 {epoch_end}"]
        + ["train_end"]
    )


def test_early_stopping_stops_and_progress_bar_prints(mnist, capsys):
    (x, y), _ = mnist
    stop = keras.callbacks.EarlyStopping(monitor="loss", patience=0, min_delta=10.0)
    history = keras_dp.fit_sharded(mlp(), x[:256], y[:256], batch_size=64, epochs=5,
                                   verbose=1, callbacks=[stop], devices=devices(2))
    assert history.epoch == [0, 1]  # no 10.0 improvement: stops after epoch 2
    out = capsys.readouterr().out
    assert "Epoch 1/5" in out and "4/4" in out


@pytest.mark.slow
def test_model_keeps_trained_weights_when_training_raises_mid_epoch(mnist):
    (x, y), _ = mnist
    batches = [(x[i:i + 64], y[i:i + 64]) for i in range(0, 640, 64)]

    class Boom(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 5:
                raise RuntimeError("boom")

    model = convnet(seed=4)
    initial = weights(model)
    with pytest.raises(RuntimeError, match="boom"):
        keras_dp.fit_sharded(model, batches, callbacks=[Boom()], verbose=0, devices=devices(2))
    # The model holds the state after exactly the 6 steps that ran.
    reference = convnet(seed=4)
    trainer = keras_dp.ShardedTrainer(reference, devices=devices(2))
    trainer.build(batches[0])
    state = trainer.init_state()
    for batch in batches[:6]:
        state, _ = trainer.train_step(state, trainer.shard(batch))
    trainer.write_back(state)
    after = weights(model)
    assert any(not np.array_equal(a, b) for a, b in zip(initial, after))
    for a, b in zip(weights(reference), after):
        np.testing.assert_array_equal(a, b)
    assert np.isfinite(model.predict(x[:8], verbose=0)).all()


def test_compile_arguments_override_and_uncompiled_models_train(mnist):
    (x, y), _ = mnist
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Flatten(), keras.layers.Dense(10)])  # unbuilt, uncompiled
    history = keras_dp.fit_sharded(
        model, x[:256] / 255.0, y[:256], batch_size=64, epochs=2, verbose=0,
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"], devices=devices(4),
    )
    assert model.built and isinstance(model.optimizer, keras.optimizers.SGD)
    assert history.history["loss"][1] < history.history["loss"][0]


def test_subclassed_and_functional_models_train(mnist):
    (x, y), _ = mnist

    inputs = keras.Input((28, 28, 1))
    functional = keras.Model(inputs, keras.layers.Dense(10)(keras.layers.Flatten()(inputs / 255.0)))
    for model in (SubclassedClassifier(), functional):
        keras_dp.models.compile_classifier(model)
        history = keras_dp.fit_sharded(model, x[:512], y[:512], batch_size=64, epochs=2,
                                       verbose=0, devices=devices(8))
        assert history.history["loss"][1] < history.history["loss"][0]


@pytest.mark.slow  # 26 s on 2 cores
def test_resnet18_is_d2ls_and_its_loss_falls_on_two_devices(mnist):
    (x, y), _ = mnist
    model = keras_dp.models.resnet18()
    # d2l's multi-GPU ResNet-18 for 28x28 inputs and 10 classes (BatchNorm
    # moving statistics included in Keras's count).
    assert model.count_params() == 11_183_626
    assert model.output_shape == (None, 10)
    keras_dp.models.compile_classifier(model, learning_rate=1e-3)
    # One batch of 32 per epoch: each epoch's loss is one step's loss.
    history = keras_dp.fit_sharded(model, x[:32], y[:32], batch_size=32, epochs=4,
                                   shuffle=False, verbose=0, devices=devices(2))
    losses = history.history["loss"]
    assert losses[-1] < 0.5 * losses[0], losses


def test_shuffle_batch_permutes_rows_within_each_batch_as_keras_does():
    # model.fit(shuffle="batch") keeps every batch's rows and place and permutes
    # only within a batch; keras_dp used to read "batch" as a full shuffle.
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(100, 8)).astype("float32"), rng.integers(0, 3, 100)
    batches = keras_dp.sources.make_batches(x, y, batch_size=32, shuffle="batch", seed=3)
    order = batches.order(1)
    assert not np.array_equal(order, np.arange(100))
    for start in range(0, 100, 32):
        np.testing.assert_array_equal(np.sort(order[start:start + 32]), np.arange(start, min(start + 32, 100)))

    def tiny():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    expected, model = tiny(), tiny()
    keras_losses = expected.fit(x, y, batch_size=32, epochs=2, shuffle="batch", verbose=0).history["loss"]
    history = keras_dp.fit_sharded(model, x, y, batch_size=32, epochs=2, shuffle="batch", verbose=0,
                                   devices=devices(2))
    np.testing.assert_allclose(history.history["loss"], keras_losses, rtol=1e-5)
    for left, right in zip(weights(model), weights(expected), strict=True):
        np.testing.assert_allclose(left, right, rtol=1e-5, atol=1e-5 * np.abs(right).max())


def _transfer_model():
    """A base of two Dense layers under a head, with fixed initial weights."""
    keras.utils.set_random_seed(1)
    base = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu", name="b1"),
                             keras.layers.Dense(16, activation="relu", name="b2")], name="base")
    inputs = keras.Input((8,))
    return keras.Model(inputs, keras.layers.Dense(3, name="head")(base(inputs))), base


def _transfer_compile(model, learning_rate):
    model.compile(optimizer=keras.optimizers.Adam(learning_rate),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def test_transfer_learning_freeze_then_fine_tune_equals_keras():
    # Phase 1: base frozen; phase 2: b2 unfrozen, recompiled at a lower rate.
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 8)).astype("float32"), rng.integers(0, 3, 64)
    runs = {}
    for name, fit in [
        ("keras", lambda model: model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)),
        ("keras_dp", lambda model: keras_dp.fit_sharded(model, x, y, batch_size=16, epochs=2,
                                                        shuffle=False, verbose=0, devices=devices(2))),
    ]:
        model, base = _transfer_model()
        initial = [w.copy() for w in base.get_weights()]
        base.trainable = False
        _transfer_compile(model, 1e-2)
        phase1 = fit(model).history["loss"]
        for left, right in zip(base.get_weights(), initial, strict=True):
            np.testing.assert_array_equal(left, right)  # frozen: bitwise unchanged
        base.trainable = True
        base.get_layer("b1").trainable = False
        _transfer_compile(model, 1e-3)
        phase2 = fit(model).history["loss"]
        np.testing.assert_array_equal(base.get_layer("b1").get_weights()[0], initial[0])
        assert not np.array_equal(base.get_layer("b2").get_weights()[0], initial[2])
        runs[name] = (model, phase1 + phase2)
    (expected, keras_losses), (model, losses) = runs["keras"], runs["keras_dp"]
    np.testing.assert_allclose(losses, keras_losses, rtol=1e-5)
    for left, right in zip(weights(model), weights(expected), strict=True):
        np.testing.assert_allclose(left, right, rtol=1e-5, atol=1e-5 * np.abs(right).max())


@pytest.mark.slow  # 7 s: seven fits, each compiling its steps
def test_a_program_of_several_fits_equals_keras(tmp_path):
    # fit twice (the optimizer's state carried on), evaluate then fit, a new
    # learning rate assigned, a recompile with another optimizer, and a
    # save/load_model between fits: each step equals Keras's model.fit.
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(48, 8)).astype("float32"), rng.integers(0, 3, 48)

    def program(fit):
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.BatchNormalization(), keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.Adam(1e-2),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        logs = fit(model) + fit(model) + [model.evaluate(x, y, verbose=0)] + fit(model)
        model.optimizer.learning_rate.assign(1e-3)
        logs += fit(model)
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=model.loss)
        logs += fit(model)
        path = tmp_path / f"{len(list(tmp_path.iterdir()))}.keras"
        model.save(path)
        model = keras.models.load_model(path)
        return model, logs + fit(model)

    expected, keras_logs = program(
        lambda model: model.fit(x, y, batch_size=16, shuffle=False, verbose=0).history["loss"])
    model, logs = program(lambda model: keras_dp.fit_sharded(
        model, x, y, batch_size=16, shuffle=False, verbose=0, devices=devices(2)).history["loss"])
    np.testing.assert_allclose(logs, keras_logs, rtol=1e-5)
    assert int(model.optimizer.iterations) == int(expected.optimizer.iterations) == 6
    for left, right in zip(weights(model), weights(expected), strict=True):
        np.testing.assert_allclose(left, right, rtol=1e-5, atol=1e-5 * np.abs(right).max())
    for left, right in zip(model.optimizer.variables, expected.optimizer.variables, strict=True):
        right = np.asarray(right)
        np.testing.assert_allclose(np.asarray(left), right, rtol=1e-5, atol=1e-5 * np.abs(right).max())


def _tiny_regressor():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    return model


def test_a_profile_dir_under_home_is_expanded_and_a_bad_one_refused_before_any_step(
        tmp_path, monkeypatch):
    # Before, profile_dir="~/prof" wrote its trace into a directory named "~"
    # under the working directory (checkpoint_dir expands it), and a path
    # naming a file failed after the first step with XLA's "FAILED_PRECONDITION:
    # ... is not a directory" (a JaxRuntimeError).
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    x, y = np.ones((10, 4), "float32"), np.ones((10, 1), "float32")
    keras_dp.fit_sharded(_tiny_regressor(), x, y, batch_size=3, verbose=0, devices=devices(3),
                         profile_dir="~/my runs/prof")
    assert list((home / "my runs" / "prof").rglob("*.xplane.pb"))
    assert os.listdir(work) == []  # no directory named "~" here
    (work / "notes.txt").write_text("")
    model = _tiny_regressor()
    before = weights(model)
    with pytest.raises(ValueError, match=r"^`profile_dir` must be a directory keras_dp can "
                                         r"create and write to: .*notes\.txt.*exists and is "
                                         r"not a directory\. Received: profile_dir='notes\.txt'"):
        keras_dp.fit_sharded(model, x, y, batch_size=3, verbose=0, devices=devices(3),
                             profile_dir="notes.txt")
    for left, right in zip(weights(model), before, strict=True):
        np.testing.assert_array_equal(left, right)  # no step ran
    # Before, str(7) made the trace's directory "7" in the working directory,
    # checkpoint_dir=7 was os.fspath's "expected str, bytes or os.PathLike
    # object, not int", and "" (an unset variable) meant the working directory.
    for name in ("profile_dir", "checkpoint_dir"):
        with pytest.raises(TypeError, match=rf"^`{name}` must be a directory's path \(a str "
                                            rf"or os.PathLike\)\. Received: {name}=7\.$"):
            keras_dp.fit_sharded(model, x, y, batch_size=3, verbose=0, devices=devices(3),
                                 **{name: 7})
        with pytest.raises(ValueError, match=rf"^`{name}` must name a directory; an empty "
                                             rf"path would be the working directory\. "
                                             rf"Received: {name}=''\."):
            keras_dp.fit_sharded(model, x, y, batch_size=3, verbose=0, devices=devices(3),
                                 **{name: ""})
    assert sorted(os.listdir(work)) == ["notes.txt"]


@pytest.mark.parametrize("data_on_device", [False, True])
def test_the_first_batch_is_not_read_again_at_every_step(data_on_device):
    # Each call used to read the first batch again (for the message of a
    # shape change, only needed when a call fails): for arrays that is a
    # permutation of the whole epoch's order per step, 19 ms at 1M rows.
    from unittest import mock

    from keras_dp.sources.arrays import ArrayBatches

    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 255, (96, 28, 28, 1), dtype=np.uint8), rng.integers(0, 10, 96)
    reads = {}
    for rows in (24, 96):  # 3 steps, then 12
        peek = mock.patch.object(ArrayBatches, "peek", autospec=True,
                                 side_effect=ArrayBatches.peek)
        with peek as counted:
            keras_dp.fit_sharded(mlp(), x[:rows], y[:rows], batch_size=8, verbose=0,
                                 devices=devices(2), data_on_device=data_on_device)
        reads[rows] = counted.call_count
    assert reads[24] == reads[96] and reads[96] < 12, reads
