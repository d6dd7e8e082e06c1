"""Losses, metrics and layer state users bring, against Keras's `model.fit` on one device.

Each case trains 34 rows in batches of 16 for 2 epochs with `shuffle=False`
on 3 devices (6, 5 and 5 rows per device, then a last batch of 2: fewer rows
than devices), validating on 18 rows (16 and 2), from the same initial
weights as Keras's own `fit`: every log (loss, each metric, `val_*`) within
1e-5 of its own largest entry, every weight within 1e-5 of its variable's
largest entry, and `evaluate` likewise where nothing is validated. A
metric's state is updated on the whole global batch inside the compiled
step, so a metric that is not a mean (AUC's confusion counts, F1, MeanIoU's
confusion matrix, a user's own counters) ends each epoch with Keras's value,
not an average of per-device values.
"""

import keras
import numpy as np
import pytest

import keras_dp
from conftest import assert_close_to_scale
from conftest import assert_weights_close
from conftest import devices

ROWS = 34
VAL = 18  # validation rows: batches of 16 and 2, shapes the training steps have too
OPTIONS = dict(batch_size=16, epochs=2, shuffle=False, verbose=0)
M = keras.metrics


def tabular(outputs):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 8)).astype("float32")
    labels = {
        "counts": (x[:, :1] + 0.5 * rng.normal(size=(ROWS, 1)) > 0).astype("float32"),
        "binary": (x[:, :1] + 0.5 * rng.normal(size=(ROWS, 1)) > 0).astype("float32"),
        "classes": rng.integers(0, 3, ROWS),
        "multi_label": (rng.uniform(size=(ROWS, 3)) > 0.5).astype("float32"),
        "regression": rng.normal(size=(ROWS, 2)).astype("float32"),
    }[outputs]
    return x, labels, rng.uniform(0.1, 2.0, ROWS).astype("float32")


def dense_model(units, loss, metrics=None, **compile_options):
    """`build()` of a small MLP compiled fresh each call (new metric objects too)."""
    def build():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(12, activation="relu"),
                                  keras.layers.Dense(units)])
        model.compile(keras.optimizers.SGD(0.05), loss(),
                      metrics=metrics() if metrics else None, **compile_options)
        return model
    return build


def assert_logs_close(ours, theirs):
    """Same names; each value within 1e-5 of its own largest entry."""
    assert sorted(ours) == sorted(theirs)
    for name, values in theirs.items():
        for got, expected in zip(ours[name], values, strict=True):
            assert_close_to_scale(got, expected, err_msg=name)


def assert_fit_equals_keras(build, x, y, n_devices=3, **options):
    """Train `build()` with keras_dp and with Keras; compare logs, weights and evaluate.

    `evaluate` is compared only without `validation_data`, whose `val_*`
    logs compare the same test step.
    """
    options = dict(OPTIONS, **options)
    keras.utils.set_random_seed(0)
    reference = build()
    expected = reference.fit(x, y, **options).history
    keras.utils.set_random_seed(0)
    model = build()
    history = keras_dp.fit_sharded(model, x, y, devices=devices(n_devices), **options)
    assert_logs_close(history.history, expected)
    assert_weights_close(model, reference)
    if "validation_data" in options:  # the val_* logs: the test step, compared already
        return history.history
    weights = {key: options[key] for key in ("sample_weight",) if key in options}
    scores = keras_dp.ShardedTrainer(model, devices=devices(n_devices)).evaluate(
        x, y, batch_size=16, verbose=0, return_dict=True, **weights)
    expected = reference.evaluate(x, y, batch_size=16, verbose=0, return_dict=True, **weights)
    assert_logs_close({name: [value] for name, value in scores.items()},
                      {name: [value] for name, value in expected.items()})
    return history.history


class PositiveRate(keras.metrics.Metric):
    """A user's metric with its own counters and a running maximum: not a mean."""

    def __init__(self, name="positive_rate", **kwargs):
        super().__init__(name=name, **kwargs)
        self.positive = self.add_variable((), initializer="zeros", name="positive")
        self.rows = self.add_variable((), initializer="zeros", name="rows", dtype="int32")
        self.largest = self.add_variable((), initializer="zeros", name="largest")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.positive.assign(self.positive + keras.ops.sum(keras.ops.cast(y_pred > 0, "float32")))
        self.rows.assign(self.rows + keras.ops.shape(y_pred)[0])
        self.largest.assign(keras.ops.maximum(self.largest, keras.ops.max(y_pred)))

    def result(self):
        return self.positive / keras.ops.cast(self.rows, "float32") + self.largest


METRIC_CASES = {
    "counts": (1, lambda: keras.losses.BinaryCrossentropy(from_logits=True), lambda: [
        M.AUC(num_thresholds=20, from_logits=True, name="auc"),
        M.Precision(thresholds=[0.3, 0.5, 0.7], name="precision"),
        PositiveRate()]),
    "binary": (1, lambda: keras.losses.BinaryCrossentropy(from_logits=True), lambda: [
        M.AUC(from_logits=True, name="auc"),
        M.AUC(curve="PR", from_logits=True, name="pr_auc"),
        M.Precision(thresholds=[0.3, 0.5, 0.7], name="precision"),
        M.Recall(thresholds=[0.2, 0.6], name="recall"),
        M.F1Score(threshold=0.5, name="f1"),
        PositiveRate()]),
    "multi_label": (3, lambda: keras.losses.BinaryCrossentropy(from_logits=True), lambda: [
        M.AUC(curve="PR", multi_label=True, num_labels=3, from_logits=True, name="auc"),
        M.F1Score(average="macro", threshold=0.5, name="f1"),
        M.F1Score(average=None, threshold=0.5, name="f1_per_label")]),
    "classes": (3, lambda: keras.losses.SparseCategoricalCrossentropy(from_logits=True), lambda: [
        M.SparseTopKCategoricalAccuracy(k=2, name="top_2"),
        M.MeanIoU(num_classes=3, sparse_y_pred=False, name="mean_iou"),
        M.IoU(num_classes=3, target_class_ids=[0, 2], sparse_y_pred=False, name="iou")]),
}


@pytest.mark.parametrize("case", [
    "counts",
    pytest.param("binary", marks=pytest.mark.slow),
    pytest.param("multi_label", marks=pytest.mark.slow),
    pytest.param("classes", marks=pytest.mark.slow),
])
def test_metrics_that_are_not_means_equal_kerass_over_the_global_batch(case):
    units, loss, metrics = METRIC_CASES[case]
    x, y, _ = tabular(case)
    history = assert_fit_equals_keras(dense_model(units, loss, metrics), x, y,
                                      validation_data=(x[:VAL], y[:VAL]))
    assert len(history) == 2 * (len(metrics()) + 1)


@pytest.mark.slow  # 4 s: top-k on one-hot labels and weighted AUC and Precision
def test_one_hot_top_k_and_weighted_ranking_metrics_equal_kerass():
    x, classes, weights = tabular("classes")
    one_hot = np.eye(3, dtype="float32")[classes]
    assert_fit_equals_keras(dense_model(
        3, lambda: keras.losses.CategoricalCrossentropy(from_logits=True),
        lambda: [M.TopKCategoricalAccuracy(k=2, name="top_2"),
                 M.OneHotMeanIoU(num_classes=3, name="iou")]),
        x, one_hot, n_devices=2, validation_data=(x[:VAL], one_hot[:VAL]))
    x, y, weights = tabular("binary")
    assert_fit_equals_keras(dense_model(
        1, lambda: keras.losses.BinaryCrossentropy(from_logits=True),
        weighted_metrics=[M.AUC(from_logits=True, name="auc"),
                          M.Precision(thresholds=[0.3, 0.5], name="precision")]),
        x, y, sample_weight=weights, validation_data=(x[:VAL], y[:VAL], weights[:VAL]))


class RowsAndMeans(keras.metrics.Metric):
    """A metric whose `result()` is a dict: Keras logs each entry by its own name."""

    def __init__(self, name="rows_and_means", **kwargs):
        super().__init__(name=name, **kwargs)
        self.rows = self.add_variable((), initializer="zeros", name="rows", dtype="int32")
        self.total = self.add_variable((), initializer="zeros", name="total")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.rows.assign(self.rows + keras.ops.shape(y_pred)[0])
        self.total.assign(self.total + keras.ops.sum(y_pred))

    def result(self):
        rows = keras.ops.cast(self.rows, "float32")
        return {"rows": rows, "mean_output": self.total / keras.ops.maximum(rows, 1.0)}


def test_a_metric_whose_result_is_a_dict_logs_each_entry_as_model_fit_does():
    # Before, fit failed after its first epoch: "'dict' object has no attribute 'item'".
    x, y, _ = tabular("regression")
    history = assert_fit_equals_keras(
        dense_model(2, lambda: "mse", lambda: [RowsAndMeans(), M.MeanAbsoluteError(name="mae")]),
        x, y, validation_data=(x[:11], y[:11]))
    assert history["rows"] == [ROWS, ROWS] and history["val_rows"] == [11, 11]
    assert "rows_and_means" not in history
    keras.utils.set_random_seed(0)
    model = dense_model(2, lambda: "mse", lambda: [RowsAndMeans(), M.MeanAbsoluteError(
        name="mae")])()
    # evaluate's list: the model's metrics in order, then the dict's entries by name.
    scores = keras_dp.ShardedTrainer(model, devices=devices(3)).evaluate(x, y, verbose=0)
    np.testing.assert_allclose(scores, model.evaluate(x, y, verbose=0), rtol=1e-5)
    assert scores[-1] == ROWS


class Seen(keras.layers.Layer):
    """Counts the rows it sees and keeps a running maximum, in its own `call`."""

    def build(self, shape):
        self.rows = self.add_weight(shape=(), initializer="zeros", trainable=False,
                                    name="rows")
        self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False,
                                     name="calls", dtype="int32")
        self.largest = self.add_weight(shape=(shape[-1],), initializer="zeros",
                                       trainable=False, name="largest")
        self.inference_rows = self.add_weight(shape=(), initializer="zeros", trainable=False,
                                              name="inference_rows")

    def call(self, x, training=False):
        rows = keras.ops.cast(keras.ops.shape(x)[0], "float32")
        if training:
            self.rows.assign(self.rows + rows)
            self.calls.assign(self.calls + 1)
            self.largest.assign(keras.ops.maximum(self.largest, keras.ops.max(x, axis=0)))
        else:
            self.inference_rows.assign(self.inference_rows + rows)
        return x


def test_a_layer_counting_in_call_counts_the_global_batch_as_keras_does():
    x, y, _ = tabular("regression")
    models = []
    for fit in ("keras", "sharded"):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), Seen(), keras.layers.Dense(2)])
        model.compile(keras.optimizers.SGD(0.05), "mse", steps_per_execution=2)
        options = dict(OPTIONS, validation_data=(x[:11], y[:11]))
        if fit == "keras":
            model.fit(x, y, **options)
            model.predict(x, batch_size=8, verbose=0)
        else:
            keras_dp.fit_sharded(model, x, y, devices=devices(3), **options)
            keras_dp.ShardedTrainer(model, devices=devices(3)).predict(x, batch_size=8, verbose=0)
        models.append(model)
    seen = models[1].layers[0]
    # 2 epochs of 34 rows in 3 steps each; 2 validations of 11 rows, then 34 predicted.
    assert float(seen.rows) == 2 * ROWS and int(seen.calls) == 6
    assert float(seen.inference_rows) == 2 * 11 + ROWS
    np.testing.assert_array_equal(seen.largest, np.max(x, axis=0))
    for ours, theirs in zip(models[1].layers[0].weights, models[0].layers[0].weights,
                            strict=True):
        np.testing.assert_array_equal(ours, theirs)


class AbsoluteError(keras.losses.Loss):
    """A user's loss returning one value per entry of y; `per_row` reduces each row."""

    def __init__(self, per_row=False, **kwargs):
        super().__init__(**kwargs)
        self.per_row = per_row

    def call(self, y_true, y_pred):
        values = keras.ops.abs(y_true - y_pred)
        return keras.ops.mean(values, axis=-1) if self.per_row else values


def absolute_error(y_true, y_pred):
    return keras.ops.abs(y_true - y_pred)


@pytest.mark.parametrize("loss", [AbsoluteError, lambda: absolute_error])
def test_a_loss_of_one_value_per_entry_with_row_weights_is_named_with_the_fix(loss):
    # Keras's fit fails in its first step: "Incompatible shapes for broadcasting:
    # shapes=[(16, 2), (16,)]"; keras_dp said "Give one weight per row", as given.
    x, y, weights = tabular("regression")
    model = dense_model(2, loss)()
    with pytest.raises(ValueError, match=r"sample weights \(shape \(16,\)\) do not fit its loss.*"
                       r"returns one value per entry of y \(shape \(16, 2\)\).*"
                       r"keras\.ops\.mean\(values, axis=-1\)") as raised:
        keras_dp.fit_sharded(model, x, y, sample_weight=weights, devices=devices(3), **OPTIONS)
    assert raised.value.__suppress_context__ and int(model.optimizer.iterations) == 0
    assert "Give one weight per row" not in str(raised.value)


def scalar_squared_error(y_true, y_pred):
    return keras.ops.mean(keras.ops.square(y_true - y_pred))  # one number: weights unused


LOSSES = {
    "sum": lambda: keras.losses.MeanSquaredError(reduction="sum"),
    "mean_with_sample_weight": lambda: keras.losses.MeanSquaredError(
        reduction="mean_with_sample_weight"),
    "loss_subclass": lambda: AbsoluteError(per_row=True),  # the fix of the test above
    "loss_subclass_sum": lambda: AbsoluteError(per_row=True, reduction="sum"),
    "function_per_row": lambda: lambda y_true, y_pred: keras.ops.mean(
        keras.ops.abs(y_true - y_pred), axis=-1),
    "function_scalar": lambda: scalar_squared_error,
}


@pytest.mark.slow  # 4 to 5 s each on 2 shared cores
@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_losses_and_reductions_with_sample_weights_equal_kerass_fit(loss):
    x, y, weights = tabular("regression")
    assert_fit_equals_keras(dense_model(2, LOSSES[loss], weighted_metrics=[M.MeanAbsoluteError(
        name="mae")]), x, y, sample_weight=weights)


def three_outputs(as_dict):
    """`build()` of a two-input, three-output Functional model; the third output has no loss."""
    def build():
        a, b = keras.Input((8,), name="a"), keras.Input((4,), name="b")
        hidden = keras.layers.Dense(12, activation="relu")(keras.layers.Concatenate()([a, b]))
        outputs = [keras.layers.Dense(units, name=name)(hidden)
                   for name, units in (("cls", 3), ("reg", 2), ("aux", 1))]
        scce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        if as_dict:
            model = keras.Model({"a": a, "b": b}, dict(zip(("cls", "reg", "aux"), outputs)))
            model.compile(keras.optimizers.SGD(0.05),
                          loss={"cls": scce, "reg": "mse", "aux": None},
                          metrics={"cls": [M.SparseCategoricalAccuracy(name="acc")],
                                   "reg": [M.MeanAbsoluteError(name="mae")],
                                   "aux": [M.MeanSquaredError(name="mse")]},
                          loss_weights={"cls": 1.0, "reg": 0.3, "aux": 0.0})
        else:
            model = keras.Model([a, b], outputs)
            model.compile(keras.optimizers.SGD(0.05), loss=[scce, "mse", None],
                          metrics=[[M.SparseCategoricalAccuracy(name="acc")],
                                   [M.MeanAbsoluteError(name="mae"),
                                    M.MeanSquaredError(name="mse")], []],
                          loss_weights=[0.5, 2.0, 0.0])
        return model
    return build


@pytest.mark.slow  # 7 to 14 s each on 2 shared cores
@pytest.mark.parametrize("as_dict", [True, False])
def test_a_multi_output_model_with_a_loss_left_out_and_metrics_per_output_equals_kerass(as_dict):
    rng = np.random.default_rng(1)
    x = {"b": rng.normal(size=(ROWS, 4)).astype("float32"),  # not the Inputs' order
         "a": rng.normal(size=(ROWS, 8)).astype("float32")}
    y = [rng.integers(0, 3, ROWS), rng.normal(size=(ROWS, 2)).astype("float32"),
         rng.normal(size=(ROWS, 1)).astype("float32")]
    if as_dict:
        y = dict(zip(("cls", "reg", "aux"), y))
    # Otherwise y is a list of arrays, the outputs in order, as model.fit reads it.
    validation = ({key: value[:VAL] for key, value in x.items()},
                  first_rows(y, VAL))
    history = assert_fit_equals_keras(three_outputs(as_dict), x, y, validation_data=validation)
    assert "aux_loss" not in history and "val_cls_acc" in history


def first_rows(tree, rows):
    return {key: value[:rows] for key, value in tree.items()} if isinstance(tree, dict) else [
        value[:rows] for value in tree]


def numpy_loss(y_true, y_pred):
    return np.mean(np.square(np.asarray(y_true) - np.asarray(y_pred)), axis=-1)


class NumpyTotal(keras.metrics.Metric):
    """A metric written with numpy, as for eager TensorFlow: JAX cannot trace it."""

    def __init__(self, name="numpy_total", **kwargs):
        super().__init__(name=name, **kwargs)
        self.total = self.add_variable((), initializer="zeros", name="total")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.total.assign(self.total + float(np.sum(np.asarray(y_pred))))

    def result(self):
        return self.total


class NumpyLayer(keras.layers.Layer):
    def call(self, x):
        return x if float(keras.ops.max(x)) > 0 else -x


@pytest.mark.parametrize("part, where", [
    ("loss", r"The loss, numpy_loss, cannot be compiled: user code \(numpy_loss, line"),
    ("metric", r"compiled loss or metrics cannot be compiled: user code "
               r"\(NumpyTotal\.update_state, line"),
    ("layer", r"The model cannot be compiled: user code \(NumpyLayer\.call, line"),
])
def test_a_loss_metric_or_layer_written_with_numpy_is_named_with_the_fix(part, where):
    # Keras's fit on JAX traces them even with run_eagerly=True, and fails with
    # JAX's TracerArrayConversionError or ConcretizationTypeError. keras_dp
    # said "The labels do not fit the model's output" for the loss, "Check
    # that x matches the model's inputs" for the layer, and raised JAX's error
    # from inside Keras's build for the metric.
    x, y, _ = tabular("regression")
    # Unbuilt, so that keras_dp builds it from the data: with a keras.Input,
    # Keras's Sequential already fails when made.
    model = keras.Sequential([keras.layers.Dense(2), NumpyLayer()] if part == "layer" else
                             [keras.Input((8,)), keras.layers.Dense(2)])
    model.compile("sgd", numpy_loss if part == "loss" else "mse",
                  metrics=[NumpyTotal()] if part == "metric" else None, run_eagerly=True)
    with pytest.raises(ValueError, match=where + r".* reads a tensor's value in Python.*"
                       r"Write it with keras\.ops") as raised:
        with pytest.warns(UserWarning, match="run_eagerly"):
            keras_dp.fit_sharded(model, x, y, devices=devices(2), **OPTIONS)
    assert raised.value.__cause__ is None and raised.value.__suppress_context__


@pytest.mark.slow  # 5 s: an ensemble's compilation
def test_an_ensemble_of_members_with_a_dict_metric_logs_its_entries():
    # Before, fit_ensemble failed at its first validation batch ("unsupported
    # operand type(s) for /: 'dict' and 'int").
    x, labels, _ = tabular("classes")

    def member():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=[RowsAndMeans()])
        return model

    history = keras_dp.fit_ensemble(member, x, labels, members=2, validation_data=(
        x[:7], labels[:7]), devices=devices(2), **OPTIONS).history.history
    assert history["rows"] == [ROWS, ROWS] and history["val_rows"] == [7, 7]
    assert "rows_and_means" not in history and len(history["mean_output"]) == 2
