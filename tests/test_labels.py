"""Labels that are not class ids fail before they are trained on (`keras_dp.checks.labels`)."""

import keras
import numpy as np
import pytest

import keras_dp
from keras_dp.checks import labels
from conftest import BatchEnds, assert_weights_close, devices

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


def nested_outputs():
    """A model whose outputs nest a dict in a tuple, each compiled with its own loss."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    outputs = (keras.layers.Dense(2, name="reg")(hidden),
               {"cls": keras.layers.Dense(3, name="cls")(hidden)})
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=(
        "mse", {"cls": keras.losses.SparseCategoricalCrossentropy(from_logits=True)}))
    return model


def test_nested_outputs_train_as_keras_and_their_class_ids_are_checked(data):
    # Keras's fit takes losses and labels that nest as the outputs do. The
    # check flattened the labels but not the losses, and failed on the dict
    # with "KeyError: 0" before any step.
    x, y = data
    classes = y % 3
    labels = (np.stack([x[:, 0], x[:, 1]], axis=1), {"cls": classes})
    reference = nested_outputs()
    expected = reference.fit(x, labels, batch_size=40, epochs=2, shuffle=False, verbose=0)
    model = nested_outputs()
    history = fit(model, x, labels, batch_size=40, epochs=2, shuffle=False)
    for key, values in expected.history.items():
        np.testing.assert_allclose(history.history[key], values, rtol=1e-5, err_msg=key)
    assert_weights_close(model, reference)
    bad = classes.copy()
    bad[7] = 3
    with pytest.raises(ValueError, match=r"of the training data \(output cls\).*y\[7\] = 3 .*from 0 to 2"):
        fit(nested_outputs(), x, (labels[0], {"cls": bad}), batch_size=40)


def test_keras_loss_function_knows_kerass_losses_by_identity_not_by_module():
    sparse = keras.losses.sparse_categorical_crossentropy
    assert labels.keras_loss_function("sparse_categorical_crossentropy") is sparse
    assert labels.keras_loss_function(keras.losses.SparseCategoricalCrossentropy()) is sparse
    assert labels.keras_loss_function(sparse) is sparse
    assert labels.keras_loss_function("mse") is keras.losses.mean_squared_error
    assert labels.keras_loss_function(keras.losses.Huber()) is keras.losses.huber

    def my_loss(y_true, y_pred):
        return keras.ops.mean(keras.ops.abs(y_true - y_pred))

    assert labels.keras_loss_function(my_loss) is None
    assert labels.keras_loss_function("no_such_loss") is None
