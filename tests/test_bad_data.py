"""Data a user gets wrong, or gets odd: label forms, row counts, changing shapes, empty input.

Each case is either trained as Keras's own `model.fit` trains it on one
device (losses within rtol 1e-5, each weight within 1e-5 of its variable's
largest entry), or refused before the first step with a message that names
whose data it is, what is wrong and the fix. 3 simulated devices, 30 rows
in batches of 8 (3, 3 and 2 rows per device, and a last batch of 6).
"""

import warnings

import jax.numpy as jnp
import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dp
from conftest import assert_weights_close, devices

ROWS = 30
FIT = dict(batch_size=8, epochs=2, shuffle=False, verbose=0)


@pytest.fixture
def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(ROWS, 6)).astype("float32"), rng.integers(0, 4, ROWS)


def mlp(loss="sparse_categorical_crossentropy", outputs=4, activation=None):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(outputs, activation=activation)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    return model


def fit(model, *data, **kwargs):
    return keras_dp.fit_sharded(model, *data, devices=devices(3), **dict(FIT, **kwargs))


def assert_trains_as_keras(build, *data):
    ours, theirs = build(), build()
    history = fit(ours, *data)
    expected = theirs.fit(*data, **FIT)
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-5)
    assert_weights_close(ours, theirs)


@pytest.mark.parametrize("case", ["ignore_class", "sparse_column", "binary_row", "binary_column"])
def test_label_forms_keras_accepts_train_as_keras(data, case):
    # SparseCategoricalCrossentropy(ignore_class=-1) with every third label
    # ignored; labels of shape (N, 1) against (N,) for a sparse and a binary loss.
    x, y = data
    if case == "ignore_class":
        y = y.copy()
        y[::3] = -1
        assert_trains_as_keras(lambda: mlp(keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, ignore_class=-1)), x, y)
    elif case == "sparse_column":
        assert_trains_as_keras(mlp, x, y[:, None])
    else:
        binary = (y % 2).astype("float32")
        assert_trains_as_keras(lambda: mlp("binary_crossentropy", 1, "sigmoid"), x,
                               binary if case == "binary_row" else binary[:, None])


def as_dtype(array, dtype):
    """`array` as numpy in `dtype`, ml_dtypes' too (as `np.asarray(jax_array)` gives them)."""
    return np.asarray(jnp.asarray(array, dtype))


@pytest.mark.parametrize("case", ["x_bfloat16", "x_float8", "x_complex64", "one_hot_bfloat16"])
def test_numbers_of_every_dtype_keras_takes_train_as_keras(data, case):
    # numpy gives ml_dtypes' bfloat16 and float8 the kind 'V', as structured
    # arrays: they were refused ("keras_dp trains on numeric arrays only"),
    # and so was complex64, which Keras's layers cast to their dtype (the
    # imaginary part dropped, with JAX's ComplexWarning) and a layer of its
    # own can take whole.
    x, y = data
    if case == "one_hot_bfloat16":
        assert_trains_as_keras(lambda: mlp("categorical_crossentropy"), x,
                               as_dtype(np.eye(4)[y], "bfloat16"))
        return
    dtype = {"x_bfloat16": "bfloat16", "x_float8": "float8_e4m3fn"}.get(case)
    x = as_dtype(x, dtype) if dtype else x + 1j * x[::-1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", np.exceptions.ComplexWarning)
        assert_trains_as_keras(mlp, x, y)


def test_a_tf_data_pipeline_of_bfloat16_and_a_bfloat16_label_check(data):
    x, y = data
    dataset = tf.data.Dataset.from_tensor_slices((tf.cast(x, tf.bfloat16), tf.cast(y, tf.uint8)))
    ours, theirs = mlp(), mlp()
    keras_dp.fit_sharded(ours, dataset.batch(8), devices=devices(3), epochs=2, shuffle=False,
                         verbose=0)
    theirs.fit(dataset.batch(8), epochs=2, shuffle=False, verbose=0)
    assert_weights_close(ours, theirs)
    # Sparse labels in bfloat16 are checked as class ids, as float32 ones are.
    labels = y.astype("float32")
    labels[5] = 2.5
    with pytest.raises(ValueError, match=r"A label of the training data is not a class id: "
                       r"y\[5\] = 2.5 \(row 5\)"):
        fit(mlp(), x, as_dtype(labels, "bfloat16"))


@pytest.mark.parametrize("array, named", [
    (np.zeros((30, 6), np.longdouble), "a dtype Keras does not take .*Invalid dtype: float128.*"
                                       r"x.astype\('float32'\)"),
    (as_dtype(np.zeros((30, 6)), "int4"), "a dtype Keras does not take"),
    (np.zeros(30, [("a", "f4"), ("b", "f4")]), "a structured array of fields a, b.*"
                                              "structured_to_unstructured"),
    (np.ones((30, 6), object), "holding Python numbers.*"
                               r"np.asarray\(x, dtype='float32'\)"),
], ids=["longdouble", "int4", "structured", "object_numbers"])
def test_a_dtype_keras_does_not_take_is_refused_with_the_fix(data, array, named):
    # Before: float128 and int4 failed in the model's build with Keras's
    # "Invalid dtype: float128"; a structured array, or an object array of
    # numbers, got the message for ragged sequences ("pad them to one
    # length"), and none named whose data nor which array.
    model = mlp()
    with pytest.raises(ValueError, match=r"^The training data has an array of dtype .* \(x, "
                       r"shape \(30,[^)]*\)\),? " + named):
        fit(model, array, data[1])
    assert int(model.optimizer.iterations.numpy()) == 0


def two_inputs():
    keras.utils.set_random_seed(0)
    a, b = keras.Input((3,), name="a"), keras.Input((3,), name="b")
    model = keras.Model({"a": a, "b": b}, keras.layers.Dense(4)(keras.layers.Concatenate()([a, b])))
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    return model


@pytest.mark.parametrize("case, named", [
    ("sample_weight", "The training data .*: x 30, y 30, sample_weight 29"),
    ("dict_x", r"The training data .*: x\['a'\] 30, x\['b'\] 29, y 30"),
    ("validation", "The validation data .*: x 10, y 9"),
    ("validation_weight", "The validation data .*: x 10, y 10, sample_weight 9"),
], ids=["sample_weight", "dict_x", "validation", "validation_weight"])
def test_arrays_of_different_lengths_are_named_by_role_and_count(data, case, named):
    # Before: "Every array of a batch must have the same number of rows ...
    # Received arrays of shapes [(30, 6), (30,), (29,)]": neither which array
    # nor whose data (training or validation).
    x, y = data
    model = two_inputs() if case == "dict_x" else mlp()
    arguments = {
        "sample_weight": dict(x=x, y=y, sample_weight=np.ones(29)),
        "dict_x": dict(x={"a": x[:, :3], "b": x[:29, 3:]}, y=y),
        "validation": dict(x=x, y=y, validation_data=(x[:10], y[:9])),
        "validation_weight": dict(x=x, y=y, validation_data=(x[:10], y[:10], np.ones(9))),
    }[case]
    with pytest.raises(ValueError, match=(
            named + r"\. Each needs one row per sample, and keras_dp, like model.fit, "
            "does not cut them to the shortest")) as raised:
        fit(model, **arguments)
    assert raised.value.__cause__ is None and raised.value.__context__ is None
    assert int(model.optimizer.iterations.numpy()) == 0


def test_a_validation_batch_of_different_lengths_is_named_as_the_validation_datas(data):
    # Before: "Batch 1 of epoch 1 has arrays without the same number of rows",
    # as for the training data's batch 1.
    x, y = data
    with pytest.raises(ValueError, match=(
            r"^Batch 1 of epoch 1 of the validation data has arrays without the same number "
            r"of rows \(their first dimension\): shapes \[\(8, 6\), \(7,\)\]")):
        fit(mlp(), x, y, validation_data=[(x[:8], y[:8]), (x[8:16], y[8:15])])


class Batches(keras.utils.PyDataset):
    def __init__(self, batches):
        super().__init__()
        self.batches = batches

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, index):
        return self.batches[index]


def empty_tf_data(x, y):
    return tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda row, label: label > 9).batch(8)


@pytest.mark.parametrize("case, named", [
    ("tf_data", "The training data, a tf.data.Dataset, yielded no batches: it is empty"),
    ("generator", "The training data, a generator, yielded no batches: it is empty"),
    ("validation_list", "The validation data, a list, yielded no batches: it is empty"),
    ("validation_py_dataset", "The validation data, a keras.utils.PyDataset, yielded no batches"),
    ("validation_arrays", "The validation data has no rows"),
], ids=["tf_data", "generator", "validation_list", "validation_py_dataset", "validation_arrays"])
def test_empty_input_is_named_with_whose_it_is_and_the_fix(data, case, named):
    # Before: "The dataset yielded no batches in epoch 1. If it is a generator
    # or iterator, it is used up after one pass ...", for training and
    # validation data alike, and for a tf.data filter that drops every element.
    x, y = data
    arguments = {
        "tf_data": dict(x=empty_tf_data(x, y), batch_size=None),
        "generator": dict(x=(batch for batch in []), batch_size=None),
        "validation_list": dict(x=x, y=y, validation_data=[]),
        "validation_py_dataset": dict(x=x, y=y, validation_data=Batches([])),
        "validation_arrays": dict(x=x, y=y, validation_data=(x[:0], y[:0])),
    }[case]
    model = mlp()
    with pytest.raises(ValueError, match=named) as raised:
        fit(model, **arguments)
    if case != "validation_arrays":
        assert "a filter that drops every element, take(0)" in str(raised.value)
    assert int(model.optimizer.iterations.numpy()) == 0


@pytest.mark.parametrize("steps_per_execution, trained", [(1, 2), (4, 0)])
def test_a_batch_whose_structure_changes_is_named_in_words(steps_per_execution, trained):
    # A tuple x in the first batches, one array x in batch 2. Before, the
    # message showed jax's PyTreeDef((*, *, None)) instead of PyTreeDef(((*, *), *, None)).
    keras.utils.set_random_seed(0)
    a, b = keras.Input((3,)), keras.Input((3,))
    model = keras.Model([a, b], keras.layers.Dense(4)(keras.layers.Concatenate()([a, b])))
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 3)).astype("float32"), rng.integers(0, 4, 8)
    batches = [((x, x), y), ((x, x), y), (np.concatenate([x, x], 1), y)]
    with pytest.raises(ValueError, match=(
            r"^Batch 2 of epoch 1 has a different structure from the first batch: its x is an "
            r"array, where the first batch's was a tuple of 2 arrays\. Every batch must hold")):
        fit(model, batches, batch_size=None, steps_per_execution=steps_per_execution)
    # The batches before it trained; with 4 steps per call, batch 2 is read
    # for the first call, so none has.
    assert int(model.optimizer.iterations.numpy()) == trained


def sequences():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((None, 3)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(4)])
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def images():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((None, None, 2)),
                              keras.layers.Conv2D(4, 3, activation="relu"),
                              keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(4)])
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.slow  # 8 s on the 2-core VM
@pytest.mark.parametrize("steps_per_execution", [1, 4])
def test_batches_whose_length_or_image_size_changes_train_as_keras(steps_per_execution):
    # A generator of sequences of lengths 5, 5, 7, 5, 9, 9, 9, 9, 4 (7 rows
    # each) and of images of sides 6, 6, 8, ... (5 rows each): every batch
    # trains, none is dropped or padded, and the weights are Keras's, fed the
    # same batches by a PyDataset.
    rng = np.random.default_rng(1)
    for build, shapes, rows in ((sequences, [(n, 3) for n in (5, 5, 7, 5, 9, 9, 9, 9, 4)], 7),
                                (images, [(n, n, 2) for n in (6, 6, 8, 6, 8, 8, 8, 8, 7)], 5)):
        batches = [(rng.normal(size=(rows, *shape)).astype("float32"), rng.integers(0, 4, rows))
                   for shape in shapes]
        ours, theirs = build(), build()
        history = keras_dp.fit_sharded(
            ours, (batch for batch in batches), verbose=0, devices=devices(3), shuffle=False,
            steps_per_execution=steps_per_execution)
        theirs.compile(optimizer=theirs.optimizer, loss=theirs.loss,
                       steps_per_execution=steps_per_execution)
        expected = theirs.fit(Batches(batches), verbose=0, shuffle=False)
        assert int(ours.optimizer.iterations.numpy()) == len(batches)
        np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-5)
        assert_weights_close(ours, theirs)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_nan_or_inf_input_row_stops_at_its_batch_where_kerass_weights_go_nan(data, bad):
    # Row 19 is in batch 2. keras_dp's step keeps the weights it was given;
    # Keras's fit applies it, and under TerminateOnNaN stops with NaN weights.
    x, y = data
    x = x.copy()
    x[19, 2] = bad
    two_steps = mlp()
    fit(two_steps, x[:16], y[:16], epochs=1)
    stopped = mlp()
    with pytest.raises(FloatingPointError, match=r"nan at epoch 1, batch 2 .*the model holds "
                       r"the weights after 2 steps of epoch 1\. Check that batch for NaN or Inf "
                       r"inputs"):
        fit(stopped, x, y)
    ours, theirs = mlp(), mlp()
    history = fit(ours, x, y, callbacks=[keras.callbacks.TerminateOnNaN()])
    expected = theirs.fit(x, y, callbacks=[keras.callbacks.TerminateOnNaN()], **FIT)
    assert history.epoch == expected.epoch == [0]
    assert np.isnan(history.history["loss"]).all() and np.isnan(expected.history["loss"]).all()
    for model in (stopped, ours):
        assert int(model.optimizer.iterations.numpy()) == 2
        for mine, before in zip(model.get_weights(), two_steps.get_weights(), strict=True):
            np.testing.assert_array_equal(mine, before)
    assert int(theirs.optimizer.iterations.numpy()) == 3
    assert not np.isfinite(theirs.get_weights()[0]).all()
    weights = np.ones(ROWS)
    weights[19] = bad  # named among the causes: before, only "inputs or labels"
    with pytest.raises(FloatingPointError, match=r"batch 2 .*NaN or Inf inputs, labels or "
                       r"sample weights"):
        fit(mlp(), data[0], y, sample_weight=weights)


def test_under_terminate_on_nan_the_epochs_metrics_log_nan_where_kerass_count_the_bad_step(data):
    # README said "the same History" as Keras's: the loss is nan in both, but
    # keras_dp sets the running metrics to NaN at the bad step (so that the
    # steps after it keep the state), where Keras's accuracy counts that step.
    x, y = data
    x = x.copy()
    x[19, 2] = np.nan  # batch 2

    def build():
        model = mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=model.loss, metrics=["accuracy"])
        return model

    ours, theirs = build(), build()
    history = fit(ours, x, y, callbacks=[keras.callbacks.TerminateOnNaN()]).history
    expected = theirs.fit(x, y, callbacks=[keras.callbacks.TerminateOnNaN()], **FIT).history
    assert sorted(history) == sorted(expected) == ["accuracy", "loss"]
    assert np.isnan(history["loss"]).all() and np.isnan(expected["loss"]).all()
    assert np.isnan(history["accuracy"]).all()
    np.testing.assert_allclose(expected["accuracy"], [0.25])  # 6 of the 24 rows read


def test_an_empty_grain_dataset_is_named_as_grain(data):
    grain = pytest.importorskip("grain")
    x, y = data
    with pytest.raises(ValueError, match=r"^The validation data, a Grain \w+, yielded no "
                       r"batches: it is empty"):
        fit(mlp(), x, y, validation_data=grain.MapDataset.source([]).batch(8))


def test_evaluate_and_predict_on_empty_input_name_no_epoch():
    # They said "yielded no batches in epoch 1", though neither has epochs.
    trainer = keras_dp.ShardedTrainer(mlp(), devices=devices(2))
    for run in (trainer.evaluate, trainer.predict):
        with pytest.raises(ValueError, match=r"^The data, a list, yielded no batches: it is "
                                             r"empty, and keras_dp, like model.fit, needs"):
            run([])
