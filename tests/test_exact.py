"""Exact data parallelism: any batch size, any length, the one-device answer.

Batches that do not divide by the device count are padded for the transfer
and cut back to their real rows inside the compiled step; these tests check
that the result is what Keras computes on one device, sample for sample.
"""

import json
import os
import pathlib
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_dp
from conftest import NO_GRADIENT, assert_weights_equal, convnet, devices, mlp, sgd_mlp, weights

FLOAT64_SCRIPT = pathlib.Path(__file__).parent / "scripts" / "exact_float64.py"
APPLICATIONS_SCRIPT = pathlib.Path(__file__).parent / "scripts" / "exact_applications.py"
# float32 comparisons against Keras on one device: the two runs sum in a
# different order (per device, then all-reduced), and the order itself
# depends on the CPU (vector width, kernels, threads), so each comparison
# allows rounding at a scale of its own. A variable's absolute tolerance is
# a fraction of its own largest entry (`assert_variables_close`), not one
# atol for all: a fixed 1e-6 is 1e-5 of a 0.1 kernel but 4e-4 of a 0.0025
# BatchNorm offset.
# Weights after a few steps of the MLP: measured on one CPU over 42 pairs of
# runs (6 seeds x 2-8 devices) at most 7e-8 of the variable's largest entry
# beyond rtol; from weights perturbed by 1e-6 (10x the rounding) at most
# 3e-6. Counting padding rows moves every variable by 2e-3 or more of its own.
MLP_K = 3e-5
# One epoch of the convnet: float32 rounding alone stays below 1e-6 of each
# variable's largest entry, but sometimes a ReLU input lies within rounding
# of 0 and takes the other side in one of the runs; that sample's gradient
# then differs outright, and momentum and BatchNorm carry it into every
# later step. Measured on one CPU: in 4 of 35 pairs of runs (seeds x 2-8
# devices x vector ISAs), and in 18 of 40 runs of this test's model from
# weights perturbed by 3e-7, up to 2.1e-3 of a BatchNorm offset's largest
# entry after the epoch (an AMD EPYC was reported 2.5e-6 off in a conv
# kernel whose largest entry is about 0.07, failing the old fixed atol 1e-6).
# Counting the 2 padding rows of the 40-row last batch moves the offsets
# by 0.1 of theirs, and the loss by 4e-5.
CONVNET_EPOCH_K = 1e-2
# One forward pass (predict): no training to amplify rounding; measured 2e-7
# of the largest output.
PREDICT_K = 2e-5


def sgd_convnet(seed=7):
    # The guide's convnet (BatchNorm and Dropout 0.5 both active in
    # training) with SGD: Adam turns float32 rounding in near-zero
    # gradients into +-learning-rate steps, which no tolerance can follow.
    model = convnet(seed)
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                  loss=model.loss, metrics=["accuracy"])
    return model


def assert_float32_close(actual, expected, k, rtol=1e-5, err_msg=""):
    """`actual` equals `expected` to `rtol`, plus `k` times `expected`'s largest |entry|."""
    expected = np.asarray(expected)
    atol = k * float(np.max(np.abs(expected))) if expected.size else 0.0
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=rtol, atol=atol,
                               err_msg=err_msg)


def assert_variables_close(reference, ours, k=MLP_K, rtol=1e-5):
    """Every variable of `ours` equals `reference`'s up to float32 rounding.

    Float variables within `rtol` plus `k` times the reference variable's
    largest |entry|; integer variables (a seed generator's state) equal.
    """
    for va, vb in zip(reference.variables, ours.variables, strict=True):
        if va.path == NO_GRADIENT:
            continue
        expected, actual = np.asarray(va.value), np.asarray(vb.value)
        if np.issubdtype(expected.dtype, np.floating):
            assert_float32_close(actual, expected, k, rtol, err_msg=va.path)
        else:
            np.testing.assert_array_equal(actual, expected, err_msg=va.path)


def test_one_epoch_on_3_devices_equals_keras_fit_on_one(mnist):
    # 1,000 rows at batch 64 on 3 devices: no batch divides (64 % 3 = 1) and
    # the last has 40 rows. Dropout draws the same masks as under model.fit:
    # the seed generator state is part of the trained state, and JAX's
    # partitionable threefry gives the same bits however the rows are split.
    (x, y), _ = mnist
    x, y = x[:1000], y[:1000]
    keras_model, ours = sgd_convnet(), sgd_convnet()
    keras_history = keras_model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    history = keras_dp.fit_sharded(ours, x, y, batch_size=64, epochs=1, shuffle=False,
                                   verbose=0, devices=devices(3))
    assert int(ours.optimizer.iterations.numpy()) == 16
    np.testing.assert_allclose(history.history["loss"], keras_history.history["loss"], rtol=1e-5)
    assert history.history["accuracy"] == pytest.approx(keras_history.history["accuracy"], abs=1e-7)
    assert_variables_close(keras_model, ours, k=CONVNET_EPOCH_K)


@pytest.mark.slow  # 30 s; the float32 version runs in CI
def test_one_epoch_on_3_devices_equals_keras_fit_on_one_in_float64():
    # The same epoch in float64, where rounding is 1e-16 and no ReLU input
    # changes side: the weights must agree to 1e-12 of each variable's
    # largest entry. Keras computes BatchNormalization (and
    # GlobalAveragePooling's mean) in float32 even under floatx float64, and
    # the batch statistics' float32 sums are split over the devices, so the
    # script keeps those in float64 too (see its docstring); left in float32
    # they differ by 1e-7 (SGD) to 7e-4 (Adam).
    result = subprocess.run(
        [sys.executable, str(FLOAT64_SCRIPT), "--devices", "3"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    runs = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [run["optimizer"] for run in runs] == ["sgd", "adam"]
    for run in runs:
        assert run["dtype"] == "float64" and run["dtypes"] == ["float64", "uint32"]
        assert run["keras_result_type"] == "float64"
        assert run["iterations"] == [16, 16]
        assert run["integer_variables_equal"]
        np.testing.assert_allclose(run["loss"], run["keras_loss"], rtol=1e-12)
        assert run["accuracy"] == run["keras_accuracy"]
        assert len(run["relative_difference"]) == 16
        for path, difference in run["relative_difference"].items():
            assert difference <= 1e-12, (run["optimizer"], path, difference)


@pytest.mark.slow  # 90 s: compiling EfficientNetV2B0 twice in float64
def test_efficientnetv2_step_on_2_devices_equals_keras_fit_on_one_in_float64():
    # EfficientNetV2B0 (BatchNorm over 4 rows per device, 15 stochastic-depth
    # Dropouts with one mask entry per sample) differed from Keras by 3e-6 in
    # its first float32 loss. In float64 the first step agrees to rounding:
    # same loss, same stochastic-depth masks, the same BatchNorm statistics
    # over all 8 rows. Measured: loss 1.0e-14, weights 2.1e-13 of each
    # variable's largest entry. The variables left out hold rounding noise on
    # any device count (true gradient or batch mean 0: the script's docstring).
    result = subprocess.run(
        [sys.executable, str(APPLICATIONS_SCRIPT), "--model", "EfficientNetV2B0",
         "--devices", "2", "--steps", "1", "--optimizer", "sgd"],
        capture_output=True, text=True, timeout=600, env=dict(os.environ),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run = json.loads(result.stdout.splitlines()[-1])
    assert run["dtype"] == "float64" and run["result_type"] == "float64"
    assert run["dropout_layers"] == 16
    assert run["first_loss_relative"] <= 1e-12, run
    assert run["max_relative"] <= 1e-10, run
    assert run["compared"] > 300 and run["zero_truth_largest_entry"] <= 1e-12, run


@pytest.mark.parametrize("n_devices", [1, 2, 3, 4])
def test_every_sample_is_used_exactly_once_per_epoch(n_devices):
    # Each row's label is its own id; a metric adds up a histogram of the
    # ids it is shown. A padded row would count the last id twice.
    rows = 250

    class IdHistogram(keras.metrics.Metric):
        def __init__(self, name="ids"):
            super().__init__(name=name)
            self.counts = self.add_variable((rows,), initializer="zeros", name="counts")

        def update_state(self, y_true, y_pred, sample_weight=None):
            ids = keras.ops.cast(keras.ops.reshape(y_true, (-1,)), "int32")
            self.counts.assign_add(keras.ops.sum(keras.ops.one_hot(ids, rows), axis=0))

        def result(self):
            return keras.ops.convert_to_tensor(self.counts)

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    # Learning rate 0: the weights do not matter here, and SGD on labels up
    # to 250 would diverge (the trainer stops on a non-finite loss).
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", metrics=[IdHistogram()])
    ids = np.arange(rows, dtype=np.float32)
    history = keras_dp.fit_sharded(model, ids[:, None], ids, batch_size=64, epochs=2,
                                   verbose=0, devices=devices(n_devices))
    for counts in history.history["ids"]:
        np.testing.assert_array_equal(counts, np.ones(rows))
    assert int(model.optimizer.iterations.numpy()) == 2 * 4  # 64, 64, 64, 58


def test_batch_sizes_that_do_not_divide_or_are_below_the_device_count_train_exactly(mnist):
    (x, y), _ = mnist
    reference = sgd_mlp()
    reference.fit(x[:300], y[:300], batch_size=100, shuffle=False, verbose=0)
    ours = sgd_mlp()
    keras_dp.fit_sharded(ours, x[:300], y[:300], batch_size=100, shuffle=False, verbose=0,
                         devices=devices(8))  # 100 rows: 13 per device, 4 padding rows
    assert_variables_close(reference, ours)
    small = sgd_mlp()
    keras_dp.fit_sharded(small, x[:12], y[:12], batch_size=4, shuffle=False, verbose=0,
                         devices=devices(8))  # 4 rows on 8 devices
    reference = sgd_mlp()
    reference.fit(x[:12], y[:12], batch_size=4, shuffle=False, verbose=0)
    assert_variables_close(reference, small)


def test_predict_and_evaluate_on_any_length_equal_one_device(mnist):
    _, (x_test, y_test) = mnist
    x_test = np.concatenate([x_test, x_test[:100]])  # 1,124 rows
    y_test = np.concatenate([y_test, y_test[:100]])
    model = sgd_convnet()
    trainer = keras_dp.ShardedTrainer(model, devices=devices(3))
    predictions = trainer.predict(x_test[:1001], verbose=0)  # 32-row batches; the last has 9
    assert predictions.shape == (1001, 10)
    assert_float32_close(predictions, model.predict(x_test[:1001], verbose=0), k=PREDICT_K)
    ours = trainer.evaluate(x_test[:1004], y_test[:1004], verbose=0, return_dict=True)
    theirs = model.evaluate(x_test[:1004], y_test[:1004], verbose=0, return_dict=True)
    assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
    assert ours["accuracy"] == pytest.approx(theirs["accuracy"], abs=1e-7)


@pytest.mark.parametrize("on_device, program", [(False, "train_step"), (True, "resident_step")])
def test_a_partial_last_batch_compiles_the_train_step_once_more(mnist, on_device, program):
    (x, y), _ = mnist
    trainer = keras_dp.ShardedTrainer(mlp(), devices=devices(3), data_on_device=on_device)
    trainer.fit(x[:200], y[:200], batch_size=64, epochs=3, verbose=0)  # 64, 64, 64, 8
    assert getattr(trainer.programs, program)._cache_size() == 2


def test_the_same_seed_gives_bitwise_identical_weights(mnist):
    (x, y), _ = mnist
    results = []
    for _ in range(2):
        model = mlp(seed=5, dropout=0.5)
        keras_dp.fit_sharded(model, x[:500], y[:500], batch_size=50, epochs=2, seed=11,
                             verbose=0, devices=devices(3))
        results.append(weights(model))
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)
    other = mlp(seed=5, dropout=0.5)
    keras_dp.fit_sharded(other, x[:500], y[:500], batch_size=50, epochs=2, seed=12,
                         verbose=0, devices=devices(3))
    assert not np.array_equal(weights(other)[0], results[0][0])  # the seed sets the order


def test_class_weight_and_sample_weight_match_keras_fit(mnist):
    # 4 batches of 64 on 3 devices: each split unevenly, padded with rows
    # of weight 0. (A partial last batch compiled a second program in each
    # of the five fits and checked nothing more.)
    (x, y), _ = mnist
    x, y = x[:256], y[:256]
    class_weight = {0: 3.0, 1: 0.5, 7: 2.0}
    reference = sgd_mlp()
    reference.fit(x, y, batch_size=64, shuffle=False, class_weight=class_weight, verbose=0)
    ours = sgd_mlp()
    keras_dp.fit_sharded(ours, x, y, batch_size=64, shuffle=False, class_weight=class_weight,
                         verbose=0, devices=devices(3))
    assert_variables_close(reference, ours)
    # The same weights given per sample train the same way: the same
    # compiled step on the same float32 inputs, so bit for bit on any CPU.
    weighted = sgd_mlp()
    sample_weight = np.vectorize(lambda c: class_weight.get(c, 1.0))(y).astype(np.float32)
    keras_dp.fit_sharded(weighted, x, y, sample_weight=sample_weight, batch_size=64,
                         shuffle=False, verbose=0, devices=devices(3))
    assert_weights_equal(ours, weighted)
    one_hot = sgd_mlp()  # class ids read from one-hot labels
    one_hot.compile(optimizer=keras.optimizers.SGD(0.05),
                    loss=keras.losses.CategoricalCrossentropy(from_logits=True))
    reference = sgd_mlp()
    reference.compile(optimizer=keras.optimizers.SGD(0.05),
                      loss=keras.losses.CategoricalCrossentropy(from_logits=True))
    reference.fit(x, np.eye(10)[y], batch_size=64, shuffle=False, class_weight=class_weight,
                  verbose=0)
    keras_dp.fit_sharded(one_hot, x, np.eye(10)[y], batch_size=64, shuffle=False,
                         class_weight=class_weight, verbose=0, devices=devices(3))
    assert_variables_close(reference, one_hot)


def test_validation_split_and_freq_follow_keras(mnist):
    # The last 64 of 256 rows validate; 3 batches of 64 train, each split
    # unevenly over 3 devices. (400 rows gave partial batches, a second
    # train and test program in each fit, and checked nothing more.)
    (x, y), _ = mnist
    x, y = x[:256], y[:256]
    reference = sgd_mlp()
    theirs = reference.fit(x, y, batch_size=64, epochs=3, shuffle=False, validation_split=0.25,
                           validation_freq=2, verbose=0).history
    ours = keras_dp.fit_sharded(sgd_mlp(), x, y, batch_size=64, epochs=3, shuffle=False,
                                validation_split=0.25, validation_freq=2, verbose=0,
                                devices=devices(3)).history
    assert len(ours["loss"]) == 3 and len(ours["val_loss"]) == 1  # after epoch 2 only
    np.testing.assert_allclose(ours["loss"], theirs["loss"], rtol=1e-5)
    np.testing.assert_allclose(ours["val_loss"], theirs["val_loss"], rtol=1e-5)
    assert ours["val_accuracy"] == pytest.approx(theirs["val_accuracy"], abs=1e-7)
    listed = keras_dp.fit_sharded(sgd_mlp(), x, y, batch_size=64, epochs=3, verbose=0,
                                  validation_data=(x[:10], y[:10], np.ones(10)),
                                  validation_freq=[1, 3], devices=devices(3)).history
    assert len(listed["val_loss"]) == 2


def test_initial_epoch_resumes_the_same_run(mnist):
    (x, y), _ = mnist
    unbroken = mlp(dropout=0.5)
    keras_dp.fit_sharded(unbroken, x[:256], y[:256], batch_size=64, epochs=3, verbose=0,
                         devices=devices(3))
    resumed = mlp(dropout=0.5)
    keras_dp.fit_sharded(resumed, x[:256], y[:256], batch_size=64, epochs=1, verbose=0,
                         devices=devices(3))
    history = keras_dp.fit_sharded(resumed, x[:256], y[:256], batch_size=64, epochs=3,
                                   initial_epoch=1, verbose=0, devices=devices(3))
    assert history.epoch == [1, 2]
    for a, b in zip(weights(unbroken), weights(resumed)):
        np.testing.assert_array_equal(a, b)


def test_bad_array_arguments_are_refused_before_the_first_step(mnist):
    (x, y), _ = mnist
    ragged = np.array([[1, 2], [3]], dtype=object)
    with pytest.raises(ValueError, match="dtype object.*pad them to one length"):
        keras_dp.fit_sharded(mlp(), ragged, np.zeros(2), verbose=0)
    with pytest.raises(ValueError, match="either `class_weight` or `sample_weight`"):
        keras_dp.fit_sharded(mlp(), x[:64], y[:64], sample_weight=np.ones(64),
                             class_weight={0: 2.0}, verbose=0)
    with pytest.raises(ValueError, match="`validation_split` works on arrays only"):
        keras_dp.fit_sharded(mlp(), [(x[:32], y[:32])], validation_split=0.5, verbose=0)
    with pytest.raises(ValueError, match="either `validation_data` or `validation_split`"):
        keras_dp.fit_sharded(mlp(), x[:64], y[:64], validation_split=0.5,
                             validation_data=(x[:8], y[:8]), verbose=0)
    with pytest.raises(ValueError, match="leaves 0 rows for training"):
        keras_dp.fit_sharded(mlp(), x[:1], y[:1], validation_split=0.5, verbose=0)
    with pytest.raises(ValueError, match="`batch_size` must be at least 1"):
        keras_dp.fit_sharded(mlp(), x[:64], y[:64], batch_size=0, verbose=0)
    with pytest.raises(ValueError, match="`steps_per_epoch` must be at least 1"):
        keras_dp.fit_sharded(mlp(), x[:64], y[:64], steps_per_epoch=0, verbose=0)
    with pytest.raises(ValueError, match="`validation_freq` is an int"):
        keras_dp.fit_sharded(mlp(), x[:64], y[:64], validation_freq="2", verbose=0)


def test_no_collective_gathers_the_uneven_batch(mnist):
    # The cut to real rows is local to each device: the compiled step has
    # the gradient all-reduce and no all-gather of the batch.
    (x, y), _ = mnist
    trainer = keras_dp.ShardedTrainer(mlp(), devices=devices(3))
    batch = (x[:64], y[:64])
    trainer.build(batch)
    text = trainer.compiled_train_step(trainer.init_state(), trainer.shard(batch)).as_text()
    assert "all-reduce" in text
    assert "all-gather" not in text and "all-to-all" not in text


def keras_refuses_and_keras_dp_trains(mnist, batch_size):
    """`(Keras's steps, keras_dp's steps)` on 200 rows at `batch_size` over 3 devices.

    Keras's `model.fit` under `DataParallel` must fail with its `IndivisibleError`.
    """
    (x, y), _ = mnist
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices(3)))
    try:
        model = sgd_mlp()  # created under the distribution, as Keras requires
        with pytest.raises(Exception, match="should evenly divide") as error:
            model.fit(x[:200], y[:200], batch_size=batch_size, shuffle=False, verbose=0)
    finally:
        keras.distribution.set_distribution(None)
    assert type(error.value).__name__ == "IndivisibleError"
    ours = sgd_mlp()
    keras_dp.fit_sharded(ours, x[:200], y[:200], batch_size=batch_size, shuffle=False,
                         verbose=0, devices=devices(3))
    return int(model.optimizer.iterations.numpy()), int(ours.optimizer.iterations.numpy())


def test_keras_data_parallel_refuses_the_batches_we_train_exactly(mnist):
    # The peer: model.fit under keras.distribution.DataParallel needs every
    # global batch to divide by the device count, and finds out only when
    # it reaches one that does not (here the last, 2 rows, after 3 steps).
    assert keras_refuses_and_keras_dp_trains(mnist, 66) == (3, 4)


def test_keras_data_parallel_refuses_a_batch_of_64_on_3_devices_at_the_first_step(mnist):
    # README's other case: a batch size that never divides fails before
    # Keras's first step; keras_dp trains it.
    assert keras_refuses_and_keras_dp_trains(mnist, 64) == (0, 4)
