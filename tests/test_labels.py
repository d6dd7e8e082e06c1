"""Labels that are not class ids fail before they are trained on (`keras_dp.labels`)."""

import keras
import numpy as np
import pytest

import keras_dp
from conftest import BatchEnds, devices

ROWS = 96


def classifier(loss="sparse_categorical_crossentropy", classes=10):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(classes)])
    model.compile(optimizer="sgd", loss=loss)
    return model


@pytest.fixture
def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(ROWS, 8)).astype("float32"), rng.integers(0, 10, ROWS)


def fit(model, x, y=None, **kwargs):
    return keras_dp.fit_sharded(model, x, y, verbose=0, devices=devices(2), **kwargs)


@pytest.mark.parametrize("bad, shown", [
    (np.nan, "nan"), (10, "10"), (-1, "-1"), (2.5, "2.5"),
], ids=["nan", "class-count", "negative", "fractional"])
def test_a_bad_array_label_is_named_with_its_row_before_the_first_step(data, bad, shown):
    x, y = data
    y = y.astype("float32") if isinstance(bad, float) else y.copy()
    y[70] = bad
    model, ends = classifier(), BatchEnds()
    with pytest.raises(ValueError, match=(
            rf"A label of the training data is not a class id: y\[70\] = {shown} "
            r"\(row 70\).*from 0 to 9.*1 of 96 labels")):
        fit(model, x, y, batch_size=32, callbacks=[ends])
    assert ends.ends == [] and int(model.optimizer.iterations.numpy()) == 0


def test_bad_validation_labels_are_named_before_the_first_step(data):
    x, y = data
    y_val = y[:32].copy()
    y_val[5] = 12
    with pytest.raises(ValueError, match=r"of the validation data.*y\[5\] = 12"):
        fit(classifier(), x, y, validation_data=(x[:32], y_val), batch_size=32)


def test_a_bad_dataset_label_is_named_with_its_batch_as_it_arrives(data):
    x, y = data
    y = y.copy()
    y[2 * 32 + 7] = 10
    batches = [(x[i:i + 32], y[i:i + 32]) for i in range(0, ROWS, 32)]
    model, ends = classifier(), BatchEnds()
    with pytest.raises(ValueError, match=(
            r"A label of batch 2 of epoch 1 of the training data.*y\[7\] = 10 \(row 7\)")):
        fit(model, batches, callbacks=[ends])
    assert ends.ends == [0, 1]  # the batches before it trained


def test_labels_keras_accepts_are_not_refused(data):
    x, y = data
    # One-hot rows under categorical crossentropy, float targets under a
    # regression loss, an ignored class id, and a custom loss.
    one_hot = np.eye(10, dtype="float32")[y]
    fit(classifier("categorical_crossentropy"), x, one_hot, batch_size=32)
    fit(classifier("mse"), x, np.full((ROWS, 10), np.pi, "float32"), batch_size=32)
    ignored = y.copy()
    ignored[::3] = -1
    model = classifier(keras.losses.SparseCategoricalCrossentropy(ignore_class=-1))
    fit(model, x, ignored, batch_size=32)
    assert int(model.optimizer.iterations.numpy()) == 3
    custom = classifier(lambda y_true, y_pred: keras.ops.mean(y_pred) * 0)
    fit(custom, x, np.full(ROWS, 99.5, "float32"), batch_size=32)
