"""Other models, other inputs, mixed precision and optimizer features.

Each trains on 2 simulated devices; where Keras's `model.fit` can run the
same thing on one device, the results are compared with it.
"""

import jax
import keras
import numpy as np
import pytest

import keras_dp
from keras_dp.checks import errors as explain
from conftest import InferenceNoise
from conftest import SubclassedClassifier
from conftest import assert_close_to_scale, assert_weights_close
from conftest import devices
from conftest import mlp
from conftest import weights

ROWS, BATCH = 512, 64


@pytest.fixture
def data(mnist):
    (x, y), _ = mnist
    return x[:ROWS], y[:ROWS]


def fit(model, *args, **kwargs):
    kwargs = dict(dict(epochs=3, verbose=0, devices=devices(2)), **kwargs)
    return keras_dp.fit_sharded(model, *args, **kwargs).history["loss"]


def assert_falls(losses):
    assert losses[-1] < 0.9 * losses[0], losses


# -- Inputs ------------------------------------------------------------------

class Batches(keras.utils.PyDataset):
    """MNIST batches, reshuffled by its own `on_epoch_end`."""

    def __init__(self, x, y):
        super().__init__()
        self.x, self.y = x, y
        self.order = np.arange(len(x))
        self.epochs_ended = 0

    def __len__(self):
        return len(self.x) // BATCH

    def __getitem__(self, index):
        rows = self.order[index * BATCH:(index + 1) * BATCH]
        return self.x[rows], self.y[rows]

    def on_epoch_end(self):
        self.epochs_ended += 1
        self.order = np.random.default_rng(self.epochs_ended).permutation(len(self.x))


def test_a_py_dataset_trains_with_its_epoch_hooks(data):
    dataset = Batches(*data)
    trainer = keras_dp.ShardedTrainer(mlp(), devices=devices(2))
    assert_falls(trainer.fit(dataset, epochs=3, verbose=0).history["loss"])
    # Once before the first epoch, after the read to build from, as model.fit
    # calls it (test_pipeline.py::test_a_py_dataset_gets_the_hooks_keras_calls_before_its_first_epoch).
    assert dataset.epochs_ended == 4
    assert trainer.model.optimizer.iterations.numpy() == 3 * len(dataset)


class Recording(Batches):
    """`Batches` that records which batch indices were read, epoch by epoch."""

    def __init__(self, x, y):
        super().__init__(x, y)
        self.read = [[]]

    def __getitem__(self, index):
        self.read[-1].append(index)
        return super().__getitem__(index)

    def on_epoch_end(self):
        self.read.append([])


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_py_dataset_is_read_in_a_seeded_new_order_each_epoch_with_shuffle(data, shuffle):
    # As model.fit does with a PyDataset of known length, but seeded.
    dataset = Recording(*data)
    trainer = keras_dp.ShardedTrainer(mlp(), devices=devices(2), seed=3)
    trainer.fit(dataset, epochs=2, shuffle=shuffle, verbose=0)
    # Before the first epoch, batch 0 of epoch 0's order is read to build the
    # model, then on_epoch_end is called, as model.fit does.
    assert len(dataset.read[0]) == 1
    first, second = dataset.read[1], dataset.read[2]
    if shuffle:
        assert first == np.random.default_rng([3, 0]).permutation(8).tolist()
        assert second == np.random.default_rng([3, 1]).permutation(8).tolist()
        assert first != second
    else:
        assert first == second == list(range(8))


def test_a_validation_dataset_beside_training_arrays_and_their_batch_size(data):
    x, y = data
    validation = Batches(x[:128], y[:128])  # batched already: batch_size is for x
    reference = mlp()
    expected = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                             validation_data=validation).history
    history = keras_dp.fit_sharded(mlp(), x, y, batch_size=BATCH, epochs=2, shuffle=False,
                                   verbose=0, validation_data=validation, devices=devices(2))
    np.testing.assert_allclose(history.history["val_loss"], expected["val_loss"], rtol=1e-5)


class Endless(Batches):
    """`Batches` without a length, in a fixed order: an endless dataset, as `.repeat()` gives."""

    num_batches = None

    def on_epoch_end(self):
        pass

    def __getitem__(self, index):
        return super().__getitem__(index % (len(self.x) // BATCH))


class EndlessEvents(keras.utils.PyDataset):
    """An endless PyDataset of `tiny_data`'s 6-row batches that records its calls in `events`."""

    def __init__(self):
        super().__init__()
        self.x, self.y, _ = tiny_data(18)
        self.events = []

    @property
    def num_batches(self):
        return None

    def __getitem__(self, index):
        self.events.append("get")
        rows = slice(index % 3 * 6, index % 3 * 6 + 6)
        return self.x[rows], self.y[rows]

    def on_epoch_begin(self):
        self.events.append("begin")

    def on_epoch_end(self):
        self.events.append("end")


def test_an_endless_py_dataset_gets_its_epoch_hooks_around_each_epoch_as_in_model_fit():
    # Before: on_epoch_begin twice before epoch 1 (the first batch's peek, then the
    # stream), on_epoch_end never; model.fit calls both each epoch.
    data, validation = EndlessEvents(), EndlessEvents()
    model, expected = tiny(), tiny()
    history = keras_dp.fit_sharded(model, data, epochs=3, steps_per_epoch=2, verbose=0,
                                   validation_data=validation, validation_steps=1,
                                   devices=devices(3)).history
    keras_data, keras_validation = EndlessEvents(), EndlessEvents()
    want = expected.fit(keras_data, epochs=3, steps_per_epoch=2, verbose=0,
                        validation_data=keras_validation, validation_steps=1).history
    for name in want:
        np.testing.assert_allclose(history[name], want[name], rtol=1e-5, err_msg=name)
    assert_weights_close(model, expected)
    # The stream goes on across epochs: batches 0, 1 | 2, 3 | 4, 5 (rows 0-5, 6-11, 12-17, ...),
    # after batch 0 read between the hooks to build the model, as model.fit reads it.
    assert data.events == keras_data.events == (
        ["begin", "get", "end"] + ["begin", "get", "get", "end"] * 3)
    # Each validation ends a pass first, as model.fit's evaluate does.
    assert validation.events == keras_validation.events == (
        ["end"] + ["begin", "get", "end", "end"] * 2 + ["begin", "get", "end"])


def test_validation_batch_size_slices_validation_arrays_as_in_model_fit(data):
    x, y = data
    options = dict(batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                   validation_data=(x[:100], y[:100]), validation_batch_size=48)
    counts = []

    class CountValidationBatches(keras.callbacks.Callback):
        def on_test_batch_end(self, batch, logs=None):
            counts.append(batch)

    reference = mlp()
    expected = reference.fit(x, y, callbacks=[CountValidationBatches()], **options).history
    keras_counts, counts[:] = list(counts), []
    model = mlp()
    trainer = keras_dp.ShardedTrainer(model, devices=devices(2))
    history = trainer.fit(x, y, callbacks=[CountValidationBatches()], **options).history
    # 100 validation rows as batches of 48, 48 and 4 (not 64 and 36), each epoch.
    assert counts == keras_counts == [0, 1, 2, 0, 1, 2]
    np.testing.assert_allclose(history["val_loss"], expected["val_loss"], rtol=1e-5)
    with pytest.raises(ValueError, match="validation_batch_size.*batched already"):
        trainer.fit(x, y, batch_size=BATCH, validation_data=Batches(x[:128], y[:128]),
                    validation_batch_size=48, verbose=0)


def test_validation_steps_and_evaluate_and_predict_steps_read_an_endless_dataset(data):
    x, y = data
    endless = Endless(x[:256], y[:256])
    reference = mlp()
    expected = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                             validation_data=endless, validation_steps=3).history
    model = mlp()
    history = keras_dp.fit_sharded(model, x, y, batch_size=BATCH, epochs=2, shuffle=False,
                                   verbose=0, validation_data=endless, validation_steps=3,
                                   devices=devices(2))
    np.testing.assert_allclose(history.history["val_loss"], expected["val_loss"], rtol=1e-5)
    trainer = keras_dp.ShardedTrainer(model, devices=devices(2))
    np.testing.assert_allclose(trainer.evaluate(endless, steps=5, verbose=0),
                               model.evaluate(endless, steps=5, verbose=0), rtol=1e-5)
    outputs = trainer.predict(Endless(x[:256], y[:256]), steps=5, verbose=0)
    assert outputs.shape == (5 * BATCH, 10)
    rows = np.concatenate([x[:256], x[:BATCH]])  # 4 batches, then the first again
    assert_close_to_scale(outputs, model.predict(rows, verbose=0))


def test_a_python_generator_trains(data):
    x, y = data

    def batches():
        while True:
            for start in range(0, ROWS, BATCH):
                yield x[start:start + BATCH], y[start:start + BATCH]

    model = mlp()
    assert_falls(fit(model, batches(), steps_per_epoch=ROWS // BATCH))
    assert model.optimizer.iterations.numpy() == 3 * ROWS // BATCH


def test_a_torch_data_loader_trains(data):
    torch = pytest.importorskip("torch")
    x, y = data
    dataset = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y.astype("int64")))
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH)
    assert_falls(fit(mlp(), loader))


# -- Inputs users bring: pandas, sparse matrices, a progress bar ---------------

def tiny(seed=0):
    """A 4-feature, 3-class softmax MLP under SGD: fast, and equal to Keras to rounding."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="relu"),
                              keras.layers.Dense(3, activation="softmax")])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model


def tiny_data(rows=20):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 4)).astype("float32")
    x[rng.random(x.shape) < 0.6] = 0  # mostly zeros, as a sparse matrix's are
    return x, rng.integers(0, 3, rows), rng.random(rows).astype("float32")


def assert_fit_equals_keras(x_keras, y_keras, x, y, **kwargs):
    """`fit_sharded(tiny(), x, y)` on 3 devices equals `tiny().fit(x_keras, y_keras)`."""
    kwargs = dict(dict(batch_size=6, epochs=2, shuffle=False, verbose=0), **kwargs)
    expected, model = tiny(), tiny()
    want = expected.fit(x_keras, y_keras, **kwargs).history
    got = keras_dp.fit_sharded(model, x, y, devices=devices(3), **kwargs).history
    assert list(got) == list(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, err_msg=name)
    assert_weights_close(model, expected)
    return model


def test_evaluate_and_predict_show_kerass_progress_bar_by_default(capsys):
    # Before, their default verbose="auto" failed in Keras's ProgbarLogger
    # with KeyError: 'epochs' (model.evaluate and model.predict pass epochs=1).
    x, y, _ = tiny_data()
    model = tiny()
    trainer = keras_dp.ShardedTrainer(model, devices=devices(3))
    assert_close_to_scale(trainer.predict(x, batch_size=8), model.predict(x, batch_size=8, verbose=0))
    np.testing.assert_allclose(trainer.evaluate(x, y, batch_size=8),
                               model.evaluate(x, y, batch_size=8, verbose=0), rtol=1e-5)
    out = capsys.readouterr().out
    # 20 rows in batches of 8: 3 steps; evaluate's bar ends with its logs.
    assert "3/3" in out and "accuracy: " in out, out


def test_pandas_data_frames_and_series_train_as_in_model_fit():
    pd = pytest.importorskip("pandas")
    x, y, sample_weight = tiny_data()
    frame, labels = pd.DataFrame(x, columns=list("abcd")), pd.Series(y)
    weights_ = pd.Series(sample_weight)
    model = assert_fit_equals_keras(frame, labels, frame, labels.to_frame(),
                                    sample_weight=weights_, validation_data=(frame, labels))
    trainer = keras_dp.ShardedTrainer(model, devices=devices(3))
    assert_close_to_scale(trainer.predict(frame, batch_size=7, verbose=0),
                          model.predict(x, batch_size=7, verbose=0))


@pytest.mark.parametrize("kind", [
    "scipy.sparse",
    pytest.param("tf.SparseTensor", marks=pytest.mark.slow),
    pytest.param("tf.data of SparseTensor", marks=pytest.mark.slow)])
def test_a_sparse_x_trains_as_the_dense_matrix_as_in_model_fit(kind):
    # Before, a sparse x beside y was refused with "`y` and `sample_weight`
    # go with array inputs only; a dataset carries its own".
    x, y, _ = tiny_data()
    if kind == "scipy.sparse":
        sparse = pytest.importorskip("scipy.sparse").csr_matrix(x)
    else:
        tf = pytest.importorskip("tensorflow")
        sparse = tf.sparse.from_dense(x)
    if kind == "tf.data of SparseTensor":
        data = tf.data.Dataset.from_tensor_slices((sparse, y)).batch(6)
        assert_fit_equals_keras(data, None, data, None, batch_size=None, validation_data=data)
        return
    if kind == "tf.SparseTensor":
        assert_fit_equals_keras(x, y, sparse, y, validation_data=(sparse, y))
        return
    model = assert_fit_equals_keras(x, y, sparse, y, validation_split=0.3)
    trainer = keras_dp.ShardedTrainer(model, devices=devices(3))
    assert_close_to_scale(trainer.predict(sparse, batch_size=7, verbose=0),
                          model.predict(x, batch_size=7, verbose=0))


# -- Models ------------------------------------------------------------------

def two_in_two_out():
    keras.utils.set_random_seed(0)
    image = keras.Input((28, 28, 1), name="image")
    extra = keras.Input((4,), name="extra")
    hidden = keras.layers.Flatten()(keras.layers.Rescaling(1 / 255)(image))
    hidden = keras.layers.Dense(32, activation="relu")(
        keras.layers.Concatenate()([hidden, extra]))
    model = keras.Model(
        {"image": image, "extra": extra},
        {"digit": keras.layers.Dense(10, name="digit")(hidden),
         "size": keras.layers.Dense(1, name="size")(hidden)},
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.05),
        loss={"digit": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              "size": "mse"},
        loss_weights={"digit": 1.0, "size": 0.1},
    )
    return model


def test_a_functional_model_with_two_inputs_and_two_outputs(data):
    x, y = data
    extra = np.random.default_rng(0).normal(size=(ROWS, 4)).astype("float32")
    inputs = {"image": x, "extra": extra}
    labels = {"digit": y, "size": (x.reshape(ROWS, -1).mean(1, keepdims=True) / 255)}
    reference = two_in_two_out()
    expected = reference.fit(inputs, labels, batch_size=BATCH, epochs=3, shuffle=False,
                             verbose=0).history["loss"]
    model = two_in_two_out()
    losses = fit(model, inputs, labels, batch_size=BATCH, shuffle=False)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    assert_falls(losses)
    assert_weights_close(model, reference)


def _two_list_inputs():
    keras.utils.set_random_seed(0)
    first, second = keras.Input((3,)), keras.Input((2,))
    model = keras.Model([first, second], keras.layers.Dense(2)(
        keras.layers.Concatenate()([first, second])))
    model.compile("sgd", "mse")
    return model


@pytest.mark.parametrize("pack", [list, tuple])
def test_several_inputs_as_a_list_or_tuple_train_and_validate_as_model_fit(pack):
    rng = np.random.default_rng(0)
    first, second = rng.normal(size=(40, 3)), rng.normal(size=(40, 2))
    y = rng.normal(size=(40, 2))
    # validation_data=[x, y] is the tuple, as model.fit reads it.
    x, val = pack([first, second]), pack([pack([first[:10], second[:10]]), y[:10]])
    options = dict(batch_size=8, epochs=2, shuffle=False, validation_data=val, verbose=0)
    reference = _two_list_inputs()
    expected = reference.fit(x, y, **options).history
    model = _two_list_inputs()
    history = keras_dp.fit_sharded(model, x, y, devices=devices(2), **options).history
    assert sorted(history) == ["loss", "val_loss"]
    for key in history:
        np.testing.assert_allclose(history[key], expected[key], rtol=1e-5)
    assert_weights_close(model, reference)
    trainer = keras_dp.ShardedTrainer(model, devices=devices(2))
    np.testing.assert_allclose(trainer.evaluate(x, y, verbose=0),
                               model.evaluate(x, y, verbose=0), rtol=1e-5)


def _two_in_two_out_small(inputs):
    keras.utils.set_random_seed(0)
    first, second = keras.Input((3,), name="first"), keras.Input((2,), name="second")
    hidden = keras.layers.Concatenate()([first, second])
    model = keras.Model({"first": first, "second": second} if inputs is dict else (first, second),
                        (keras.layers.Dense(2)(hidden), keras.layers.Dense(1)(hidden)))
    model.compile("sgd", ["mse", "mse"])
    return model


@pytest.mark.parametrize("inputs", [pytest.param(tuple, marks=pytest.mark.slow), dict])  # tuple: 5 s
def test_validation_data_of_several_inputs_and_outputs_is_x_and_y_as_model_fit_reads_it(inputs):
    # [(a, b), (y1, y2)] was read as a list of 2 batches, x=a and y=b, and
    # the fit failed building ("expects 2 named input(s) ... received 1");
    # model.fit unpacks any list validation_data as (x, y[, sample_weight]).
    rng = np.random.default_rng(0)
    first, second = rng.normal(size=(40, 3)), rng.normal(size=(40, 2))
    y = (rng.normal(size=(40, 2)), rng.normal(size=(40, 1)))
    x = {"first": first, "second": second} if inputs is dict else (first, second)
    part = lambda tree, rows: jax.tree.map(lambda a: a[rows], tree)  # noqa: E731
    val_x, val_y, weight = part(x, slice(10)), part(y, slice(10)), (np.arange(10.0),) * 2
    options = dict(batch_size=8, epochs=2, shuffle=False, verbose=0)
    expected = _two_in_two_out_small(inputs).fit(
        x, y, validation_data=(val_x, val_y), **options).history["val_loss"]
    weighted = _two_in_two_out_small(inputs).fit(
        x, y, validation_data=(val_x, val_y, weight), **options).history["val_loss"]
    # A list of whole (x, y) batches stays batches: the same rows, in 2.
    batches = [(part(val_x, rows), part(val_y, rows)) for rows in (slice(5), slice(5, 10))]
    for val, reference in (([val_x, val_y], expected), ((val_x, val_y), expected),
                           ([val_x, val_y, weight], weighted), (batches, expected)):
        history = keras_dp.fit_sharded(_two_in_two_out_small(inputs), x, y, devices=devices(2),
                                       validation_data=val, **options).history
        np.testing.assert_allclose(history["val_loss"], reference, rtol=1e-5)


def _nested_inputs():
    keras.utils.set_random_seed(0)
    a, b, c = keras.Input((4,)), keras.Input((5,)), keras.Input((6,))
    model = keras.Model([[a, b], c], keras.layers.Dense(3)(keras.layers.Concatenate()([a, b, c])))
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("group", [list, tuple])
def test_nested_inputs_as_a_list_of_a_list_train_as_model_fit(group):
    # Was refused before any step: "x is a Python list of 2 items of
    # different lengths (2 to 16) ... pad them ... keras.utils.pad_sequences",
    # the 2 being the inner group's length.
    rng = np.random.default_rng(0)
    first, second, third = (rng.normal(size=(16, n)).astype("float32") for n in (4, 5, 6))
    x, y = [group([first, second]), third], rng.integers(0, 3, 16)
    reference = _nested_inputs()
    expected = reference.fit(x, y, batch_size=8, shuffle=False, verbose=0).history
    model = _nested_inputs()
    history = keras_dp.fit_sharded(model, x, y, batch_size=8, shuffle=False, verbose=0,
                                   devices=devices(2)).history
    np.testing.assert_allclose(history["loss"], expected["loss"], rtol=1e-5)
    assert_weights_close(model, reference)
    with pytest.raises(ValueError, match=r"different lengths.*x\[0\]\[0\] 16, x\[0\]\[1\] 15"):
        keras_dp.fit_sharded(model, [group([first, second[:15]]), third], y, verbose=0,
                             devices=devices(2))


def _nested_data(rows=16):
    rng = np.random.default_rng(0)
    first, second, third = (rng.normal(size=(rows, n)).astype("float32") for n in (4, 5, 6))
    return first, second, third, rng.integers(0, 3, rows)


@pytest.mark.parametrize("pack", [list, tuple])
def test_nested_inputs_without_labels_predict_and_evaluate_as_keras(pack):
    # predict read [[a, b], c] as a list of 2 batches and failed building on
    # [a, b] ("expects 3 named input(s) ... received 1"); ((a, b), c) as
    # x=(a, b), y=c. model.predict reads either as the model's inputs.
    first, second, third, y = _nested_data()
    x = pack([pack([first, second]), third])
    model = _nested_inputs()
    trainer = keras_dp.ShardedTrainer(model, devices=devices(2))
    assert_close_to_scale(trainer.predict(x, batch_size=8, verbose=0),
                          model.predict(x, batch_size=8, verbose=0))
    # With y beside it, and with y inside a (x, y) tuple, as before.
    expected = model.evaluate(x, y, batch_size=8, verbose=0)
    np.testing.assert_allclose(trainer.evaluate(x, y, batch_size=8, verbose=0), expected,
                               rtol=1e-5)
    np.testing.assert_allclose(trainer.evaluate((x, y), batch_size=8, verbose=0), expected,
                               rtol=1e-5)


class SquaredOutput(keras.layers.Layer):
    """Adds the mean square of its input as the model's only loss."""

    def call(self, z):
        self.add_loss(keras.ops.mean(keras.ops.square(z)))
        return z


def _trained_by_add_loss(nested):
    keras.utils.set_random_seed(0)
    a, b, c = keras.Input((4,)), keras.Input((5,)), keras.Input((6,))
    inputs = [[a, b], c] if nested else [a, b]
    out = SquaredOutput()(keras.layers.Dense(2)(keras.layers.Concatenate()(
        jax.tree.leaves(inputs))))
    model = keras.Model(inputs, out)
    model.compile(keras.optimizers.SGD(0.1))
    return model


@pytest.mark.parametrize("nested, pack", [(False, tuple), (True, list), (True, tuple)])
def test_a_model_trained_by_add_loss_fits_its_inputs_without_labels_as_model_fit(nested, pack):
    # keras_dp read (a, b) as x=a, y=b and [[a, b], c] as a list of batches
    # (refused with batch_size: "a dataset"); model.fit reads both as the
    # model's inputs and trains on its add_loss alone.
    first, second, third, _ = _nested_data()
    x = pack([pack([first, second]), third]) if nested else pack([first, second])
    options = dict(batch_size=8, epochs=2, shuffle=False, validation_split=0.25, verbose=0)
    reference = _trained_by_add_loss(nested)
    expected = reference.fit(x, **options).history
    model = _trained_by_add_loss(nested)
    history = keras_dp.fit_sharded(model, x, devices=devices(2), **options).history
    for key in ("loss", "val_loss"):
        np.testing.assert_allclose(history[key], expected[key], rtol=1e-5)
    assert_weights_close(model, reference)
    trainer = keras_dp.ShardedTrainer(model, devices=devices(2))
    np.testing.assert_allclose(trainer.evaluate(x, batch_size=8, verbose=0),
                               model.evaluate(x, batch_size=8, verbose=0), rtol=1e-5)


def test_a_list_that_is_not_the_models_inputs_stays_a_list_of_batches():
    first, second, third, y = _nested_data()
    model = _nested_inputs()
    trainer = keras_dp.ShardedTrainer(model, devices=devices(2))
    # Whole (x, y) batches, whose x has the model's nesting: batches.
    batches = [([[first[:8], second[:8]], third[:8]], y[:8]),
               ([[first[8:], second[8:]], third[8:]], y[8:])]
    np.testing.assert_allclose(
        trainer.evaluate(batches, verbose=0),
        model.evaluate([[first, second], third], y, batch_size=8, verbose=0), rtol=1e-5)
    # A subclassed model has no input structure: a nested list stays a list
    # of batches, and batch_size beside it says both readings and the fixes.
    with pytest.raises(ValueError, match=r"(?s)reads as a list of batches.*drop `batch_size`"
                                         r".*model's inputs.*with y.*`\(x,\)`"):
        keras_dp.ShardedTrainer(SubclassedClassifier(), devices=devices(2)).predict(
            [[first, second], third], batch_size=8, verbose=0)
    # Without batch_size, an error building on the first "batch" says so too;
    # alone in a tuple, the list is the inputs, as model.fit reads the list.
    x, model = [[first, second], third], NestedAddLoss()
    with pytest.raises(ValueError, match=r"(?s)too many values to unpack.*list of batches.*"
                                         r"model.fit would read it as the model's inputs"):
        keras_dp.fit_sharded(model, x, verbose=0, devices=devices(2))
    expected = NestedAddLoss().fit(x, batch_size=8, shuffle=False, verbose=0).history["loss"]
    model = NestedAddLoss()
    history = keras_dp.fit_sharded(model, (x,), batch_size=8, shuffle=False, verbose=0,
                                   devices=devices(2))
    np.testing.assert_allclose(history.history["loss"], expected, rtol=1e-5)


def test_memory_plan_reads_the_data_as_fit_does():
    # memory_plan read a tuple x without y as x whole: (x, y) for a
    # one-input model had "no labels"; and with data_on_device, (a, b) for a
    # two-input add_loss model was x=a, y=b ("not connected to `inputs`"),
    # [[a, b], c] a list of batches (refused beside batch_size). fit reads
    # them as (x, y) and as the model's inputs.
    first, second, third, _ = _nested_data()
    for nested in (False, True):
        x = [[first, second], third] if nested else (first, second)
        trainer = keras_dp.ShardedTrainer(_trained_by_add_loss(nested), devices=devices(2))
        plan = trainer.memory_plan(x, batch_size=8, data_on_device=True)
        assert plan.resident_data == sum(a.nbytes for a in jax.tree.leaves(x))
        trainer.memory_plan(x, batch_size=8)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile("sgd", "mse")
    y = first[:, :2]
    for data_on_device in (False, True):
        packed, apart = (keras_dp.memory_plan(model, *data, batch_size=8, devices=devices(2),
                                              data_on_device=data_on_device)
                         for data in (((first, y),), (first, y)))
        assert packed == apart
    # fit reads a list of batches as batches; a plan takes arrays, and says so
    # (and, for a list that may be the inputs, how to pass it as those).
    with pytest.raises(ValueError, match=r"fit reads this x \(a list\) as batches.*"
                                         r"next\(iter\(dataset\)\)`\)\.$"):
        keras_dp.memory_plan(model, [(first, y), (first, y)], devices=devices(2))
    with pytest.raises(ValueError, match=r"as batches.*alone as a tuple `\(x,\)`"):
        keras_dp.memory_plan(model, [[first, second], third], devices=devices(2))


class NestedAddLoss(keras.Model):
    """A subclassed model of `[[a, b], c]`, trained by its add_loss alone."""

    def __init__(self):
        keras.utils.set_random_seed(0)
        super().__init__()
        self.dense = keras.layers.Dense(2)
        self.compile(keras.optimizers.SGD(0.1))

    def call(self, x):
        (a, b), c = x
        z = self.dense(keras.ops.concatenate([a, b, c], axis=-1))
        self.add_loss(keras.ops.mean(keras.ops.square(z)))
        return z


def test_several_inputs_as_a_list_without_labels_predict_as_model_predict():
    rng = np.random.default_rng(0)
    x = [rng.normal(size=(9, 3)), rng.normal(size=(9, 2))]
    model = _two_list_inputs()
    trainer = keras_dp.ShardedTrainer(model, devices=devices(2))
    predicted = trainer.predict(x, batch_size=4, verbose=0)
    assert predicted.shape == (9, 2)
    assert_close_to_scale(predicted, model.predict(x, verbose=0))
    # Arrays of different row counts stay a list of batches, of one input.
    single = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    assert_close_to_scale(
        keras_dp.ShardedTrainer(single, devices=devices(2)).predict(
            [x[0][:5], x[0][5:]], verbose=0),
        single.predict(x[0], verbose=0))


@pytest.mark.parametrize("option", [dict(run_eagerly=True), dict(jit_compile=False)])
def test_a_model_compiled_to_run_eagerly_is_compiled_with_a_warning(option):
    x = np.linspace(-1, 1, 60, dtype="float32").reshape(20, 3)
    y = x @ np.array([[1.0], [-2.0], [0.5]], dtype="float32")
    losses = []
    for fit in ("keras", "sharded"):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse", **option)
        if fit == "keras":
            losses.append(model.fit(x, y, batch_size=5, epochs=2, shuffle=False,
                                    verbose=0).history["loss"])
            continue
        with pytest.warns(UserWarning, match=next(iter(option))):
            history = keras_dp.fit_sharded(model, x, y, batch_size=5, epochs=2, shuffle=False,
                                           verbose=0, devices=devices(2))
        losses.append(history.history["loss"])
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    assert losses[1][1] < losses[1][0]


class TrainingOnlyHead(keras.Model):
    """A layer called only in training mode, and one never called."""

    def __init__(self):
        super().__init__()
        self.body, self.head = keras.layers.Dense(3), keras.layers.Dense(3)
        self.unused = keras.layers.Dense(7)

    def call(self, x, training=False):
        out = self.body(x)
        return out + 0.5 * self.head(out) if training else out


def test_layers_called_only_in_training_or_never_do_not_stop_training():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, 4)).astype("float32"), rng.integers(0, 3, 40)
    models = []
    for built_first in (True, False):
        keras.utils.set_random_seed(0)
        model = TrainingOnlyHead()
        if built_first:  # Keras trains the head only if it was built before fit
            model(x[:1], training=True)
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        models.append(model)
    reference, model = models
    options = dict(batch_size=8, epochs=2, shuffle=False, verbose=0)
    expected = reference.fit(x, y, **options).history["loss"]
    losses = fit(model, x, y, **options)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    assert len(model.trainable_weights) == 4 and not model.unused.built
    assert_weights_close(model, reference)


def test_a_subclassed_model_built_from_the_first_batch(data):
    keras.utils.set_random_seed(0)
    model = SubclassedClassifier(dropout=0.2)  # unbuilt: keras_dp builds it, as model.fit does
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert_falls(fit(model, *data, batch_size=BATCH))


class CallWithoutTraining(keras.Model):
    """A subclassed model whose `call(self, x)` takes no `training` argument."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(3)

    def call(self, x):
        return self.dense(x)


def test_a_call_without_a_training_argument_predicts_as_model_predict():
    x = np.random.default_rng(0).normal(size=(20, 4)).astype("float32")
    model = CallWithoutTraining()
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    fit(model, x, np.arange(20) % 3, batch_size=8)
    trainer = keras_dp.ShardedTrainer(model, devices=devices(2))
    assert_close_to_scale(trainer.predict(x, batch_size=8, verbose=0), model.predict(x, verbose=0))


def stateful_rnn(stateful=True):
    """An LSTM regressor on (16, 5, 3) batches, its LSTM `stateful` (a fixed batch of 16)."""
    model = keras.Sequential([keras.Input((5, 3), batch_size=16),
                              keras.layers.LSTM(4, stateful=stateful, name="lstm"),
                              keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model


class StatefulTagger(keras.Model):
    """A subclassed model, unbuilt, with a stateful GRU inside a Bidirectional."""

    def __init__(self):
        super().__init__()
        self.rnn = keras.layers.Bidirectional(keras.layers.GRU(3, stateful=True))
        self.out = keras.layers.Dense(1)

    def call(self, x):
        return self.out(self.rnn(x))


def stateful_data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(48, 5, 3)).astype("float32"), rng.normal(size=(48, 1))


def test_a_stateful_rnn_is_refused_naming_the_layers_and_the_fix():
    x, _ = stateful_data()
    model = stateful_rnn()
    first, second = model(x[:16]), model(x[:16])  # eager calls carry the states
    assert np.abs(np.asarray(first) - np.asarray(second)).max() > 1e-3
    match = r"stateful RNN layers: lstm \(LSTM\)\..*silently ignored.*stateful=False"
    with pytest.raises(ValueError, match=match):
        keras_dp.ShardedTrainer(model, devices=devices(3))
    # Unbuilt, its states would be created inside the trace (model.fit fails there).
    with pytest.raises(ValueError, match=r"backward_gru \(GRU\), forward_gru \(GRU\)\."):
        keras_dp.ShardedTrainer(StatefulTagger(), devices=devices(3))


@pytest.mark.slow  # 6 s on the 2-core VM: two LSTM compilations
def test_the_stateful_rnn_fix_equals_kerass_fit_which_drops_the_states():
    x, y = stateful_data()
    keras.utils.set_random_seed(0)
    reference = stateful_rnn()
    model = stateful_rnn(stateful=False)  # the fix: what model.fit on JAX computes
    model.set_weights(reference.get_weights())
    options = dict(batch_size=16, epochs=2, shuffle=False, verbose=0)
    expected = reference.fit(x, y, **options).history["loss"]
    assert not np.asarray(reference.get_layer("lstm").states[0]).any()  # never carried
    np.testing.assert_allclose(fit(model, x, y, devices=devices(3), **options), expected,
                               rtol=1e-5)
    assert_weights_close(model, reference)


@pytest.mark.slow
def test_a_keras_applications_model(data):
    x, y = data
    rgb = np.repeat(np.pad(x[:128], ((0, 0), (2, 2), (2, 2), (0, 0))), 3, axis=-1)
    keras.utils.set_random_seed(0)
    model = keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35,
                                           weights=None, classes=10)
    model.compile(keras.optimizers.Adam(1e-3), "sparse_categorical_crossentropy")
    assert_falls(fit(model, rgb.astype("float32") / 255, y[:128], batch_size=32, epochs=4))


# -- Mixed precision and optimizer features ------------------------------------

@pytest.fixture
def policy():
    yield keras.mixed_precision.set_global_policy
    keras.mixed_precision.set_global_policy("float32")


def test_mixed_bfloat16_computes_in_bfloat16_and_keeps_float32_variables(data, policy):
    policy("mixed_bfloat16")
    model = mlp()
    trainer = keras_dp.ShardedTrainer(model, devices=devices(2))
    assert_falls(trainer.fit(*data, batch_size=BATCH, epochs=3, verbose=0).history["loss"])
    assert {v.dtype for v in model.trainable_variables} == {"float32"}
    assert model.layers[2].compute_dtype == "bfloat16"
    batch = trainer.shard((data[0][:BATCH], data[1][:BATCH]))
    assert "bf16[" in trainer.compiled_train_step(trainer.init_state(), batch).as_text()


def test_mixed_bfloat16_on_2_devices_equals_keras_fit_within_1e3_of_each_variable(data, policy):
    # The tolerance docs/guides/exactness.md states for mixed precision: the
    # steps compute in bfloat16 (8 bits of mantissa), and 2 devices sum each
    # gradient's two halves in another order than one device does.
    policy("mixed_bfloat16")
    reference, model = mlp(), mlp()
    options = dict(batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    expected = reference.fit(*data, **options).history["loss"]
    losses = fit(model, *data, devices=devices(2), **options)
    np.testing.assert_allclose(losses, expected, rtol=1e-3)
    assert_weights_close(model, reference, scale=1e-3)
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations) == 16


def test_mixed_float16_trains_with_dynamic_loss_scaling(data, policy):
    policy("mixed_float16")
    model = mlp()
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert_falls(fit(model, *data, batch_size=BATCH))
    assert {v.dtype for v in model.trainable_variables} == {"float32"}
    # The scale lives in the optimizer's state, which keras_dp carries.
    assert float(model.optimizer.dynamic_scale.numpy()) > 1.0


@pytest.mark.parametrize("options", [
    dict(gradient_accumulation_steps=2),
    dict(use_ema=True),
    dict(clipnorm=0.1),
    dict(weight_decay=0.05),
], ids=lambda options: next(iter(options)))
def test_optimizer_features_match_keras_fit(data, options):
    def compiled():
        model = mlp()
        model.compile(keras.optimizers.AdamW(1e-2, **options), model.loss)
        return model

    reference = compiled()
    reference.fit(*data, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    model = compiled()
    fit(model, *data, batch_size=BATCH, epochs=2, shuffle=False)
    assert int(np.asarray(model.optimizer.iterations)) == int(np.asarray(reference.optimizer.iterations))
    for left, right in zip(weights(model), weights(reference), strict=True):
        assert_close_to_scale(left, right, 1e-3)  # AdamW: measured 3.7e-5


def _two_output_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((28, 28, 1))
    hidden = keras.layers.Dense(16, activation="relu")(keras.layers.Flatten()(inputs / 255.0))
    digit = keras.layers.Dense(10, name="digit")(hidden)
    odd = keras.layers.Dense(1, name="odd")(hidden)
    model = keras.Model(inputs, {"digit": digit, "odd": odd})
    zz = keras.metrics.SparseCategoricalCrossentropy(from_logits=True, name="zz_ce")
    model.compile(
        optimizer=keras.optimizers.SGD(0.05),
        loss={"digit": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              "odd": keras.losses.BinaryCrossentropy(from_logits=True)},
        metrics={"digit": [zz, "accuracy"], "odd": ["mae"]},
    )
    return model


@pytest.mark.slow  # 6 s: moved out of CI to keep the default run under 10 minutes
def test_evaluate_and_history_follow_kerass_metric_order(data):
    x, y = data[0][:155], data[1][:155]
    labels = {"digit": y, "odd": (y % 2).astype("float32")}
    reference = _two_output_model()
    expected_history = reference.fit(x, labels, batch_size=50, epochs=1, shuffle=False, verbose=0)
    expected = reference.evaluate(x, labels, batch_size=50, verbose=0)
    model = _two_output_model()
    history = keras_dp.fit_sharded(model, x, labels, batch_size=50, epochs=1, shuffle=False,
                                   verbose=0, devices=devices(3))
    assert list(history.history) == list(expected_history.history)
    got = keras_dp.ShardedTrainer(model, devices=devices(3)).evaluate(
        x, labels, batch_size=50, verbose=0)
    assert len(got) == len(expected) > 3
    np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_an_uncompiled_model_predicts_as_model_predict(data):
    x = data[0]
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Flatten(),
                              keras.layers.Dense(3)])
    got = keras_dp.ShardedTrainer(model, devices=devices(3)).predict(x[:50], verbose=0)
    assert_close_to_scale(got, model.predict(x[:50], verbose=0))
    assert not model.compiled


@pytest.mark.slow  # 5 s: moved out of CI to keep the default run under 10 minutes
def test_validation_keeps_the_test_steps_non_trainable_state_as_model_fit(data):
    # 7 timesteps of 28 pixels and whole batches: the test step's dropout
    # seed is the point, not the scan's length or a remainder's compile.
    x, y = data[0][:100, ::4, :, 0], data[1][:100]

    def lstm():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((7, 28)), keras.layers.Rescaling(1 / 255.0),
            keras.layers.LSTM(8, dropout=0.3), keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    options = dict(batch_size=50, epochs=2, shuffle=False, verbose=0,
                   validation_data=(x[:50], y[:50]))
    expected = lstm().fit(x, y, **options).history
    got = keras_dp.fit_sharded(lstm(), x, y, devices=devices(2), **options).history
    for key in ("loss", "val_loss"):
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-5)


def _augmented(layer):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((28, 28, 1)), keras.layers.Rescaling(1 / 255.0), layer,
        keras.layers.Conv2D(4, 3, activation="relu"), keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.slow  # 8 s on 2 cores
def test_layers_that_turn_off_jit_train_as_keras_run_jitted(data):
    """RandomRotation sets supports_jit=False: Keras's fit runs it un-jitted, keras_dp jitted."""
    x, y = data[0][:96], data[1][:96]
    options = dict(batch_size=32, epochs=1, shuffle=False, verbose=0)
    layer = lambda: keras.layers.RandomRotation(0.1, seed=3)  # noqa: E731
    eager = _augmented(layer())
    assert not eager.jit_compile  # Keras turns jit off for this model
    eager_history = eager.fit(x, y, **options).history
    jitted = _augmented(layer())
    jitted._jit_compile = True  # what keras_dp does: compile the step anyway
    jitted_history = jitted.fit(x, y, **options).history
    ours = _augmented(layer())
    history = keras_dp.fit_sharded(ours, x, y, devices=devices(1), **options).history
    assert history["loss"] == jitted_history["loss"]  # bitwise: the same compiled step
    assert_weights_close(ours, jitted, 1e-6)
    # Un-jitted Keras differs by float rounding only (XLA orders the arithmetic).
    np.testing.assert_allclose(history["loss"], eager_history["loss"], rtol=1e-5)
    for a, b in zip(weights(eager), weights(ours)):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-4 * np.abs(a).max())


def test_a_layer_that_cannot_compile_is_named_with_the_fix(data):
    x, y = data[0][:64], data[1][:64]
    with pytest.raises(ValueError, match="supports_jit=False: random_crop.*RandomCrop.*input pipeline"):
        keras_dp.fit_sharded(_augmented(keras.layers.RandomCrop(24, 24, seed=1)), x, y,
                             batch_size=32, verbose=0, devices=devices(2))


@pytest.mark.parametrize("steps_per_execution", [1, 2])
def test_predict_draws_new_random_numbers_each_batch_and_call_as_keras_does(steps_per_execution):
    # Before, predict dropped the non-trainable values its steps left: every
    # batch and every call drew the same numbers from the same seed state.
    def noisy():
        model = keras.Sequential([keras.Input((6,)), InferenceNoise()])
        model.compile("sgd", "mse", steps_per_execution=steps_per_execution)
        return model

    x = np.random.default_rng(0).uniform(1, 2, size=(50, 6)).astype("float32")
    reference, model = noisy(), noisy()
    trainer = keras_dp.ShardedTrainer(model, devices=devices(3))
    for _ in range(2):  # 4 batches of 16, 16, 16 and 2 rows, twice
        expected = reference.predict(x, batch_size=16, verbose=0)
        got = trainer.predict(x, batch_size=16, verbose=0)
        np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert not np.allclose(got[:16] / x[:16], got[16:32] / x[16:32])
    np.testing.assert_array_equal(np.asarray(model.layers[0].seed_generator.state.value), [7, 8])
    np.testing.assert_array_equal(np.asarray(model.layers[0].seed_generator.state.value),
                                  np.asarray(reference.layers[0].seed_generator.state.value))


def test_an_overridden_compute_loss_is_used_as_by_model_fit():
    # README (Models): a model that keeps Keras's own steps is trained with
    # Keras's compute_loss_and_updates, so its compute_loss override is used.
    class Penalised(keras.Sequential):
        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
            loss = super().compute_loss(x, y, y_pred, sample_weight, training=training)
            return loss + 0.5 * keras.ops.mean(keras.ops.square(y_pred))

    rng = np.random.default_rng(0)
    x, y = rng.random((50, 6), "float32"), rng.integers(0, 3, 50)
    results = []
    for fit_with in ("keras", "keras_dp", "keras_dp, plain"):
        keras.utils.set_random_seed(0)
        kind = keras.Sequential if fit_with.endswith("plain") else Penalised
        model = kind([keras.Input((6,)), keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        kwargs = dict(batch_size=16, epochs=2, shuffle=False, verbose=0)
        if fit_with == "keras":
            history = model.fit(x, y, **kwargs)
        else:
            history = keras_dp.fit_sharded(model, x, y, devices=devices(3), **kwargs)
        results.append((history.history["loss"], model))
    (theirs, reference), (ours, model), (plain, _) = results
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    assert_weights_close(model, reference)
    assert not np.allclose(plain, theirs, rtol=1e-3)  # the penalty counts


def three_batch_dataset_and_model():
    """34 rows in a tf.data dataset of 3 batches of 16, and a compiled 4 -> 3 Dense model."""
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(34, 4)).astype("float32"), rng.integers(0, 3, 34)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return x, y, dataset, model


def test_steps_per_epoch_beyond_a_finite_dataset_ends_each_epoch_with_the_data_as_model_fit():
    # 34 rows in batches of 16 are 3 batches a pass. With steps_per_epoch=5,
    # Keras's fit warns "Your input ran out of data" and ends each epoch after
    # the pass's 3 steps; keras_dp ran 5 steps an epoch, into the next pass,
    # and warned of it when the fit started. It now counts as Keras does, and
    # says once that the data ran out.
    import warnings

    from conftest import BatchEnds

    x, y, dataset, model = three_batch_dataset_and_model()
    ours, theirs = BatchEnds(), BatchEnds()
    options = dict(steps_per_epoch=5, epochs=2, verbose=0)
    with pytest.warns(UserWarning, match=r"The data ran out after 3 steps of epoch 1, before "
                      r"steps_per_epoch=5: as under Keras's model.fit, the epoch ends there"):
        keras_dp.fit_sharded(model, dataset, devices=devices(3), callbacks=[ours], **options)
    with pytest.warns(UserWarning, match="ran out of data"):
        model.fit(dataset, callbacks=[theirs], **options)
    assert ours.ends == theirs.ends == [0, 1, 2] * 2
    quiet = [dict(x=dataset, steps_per_epoch=3, epochs=2),  # one pass an epoch
             dict(x=x, y=y, batch_size=16, steps_per_epoch=2, epochs=1)]  # within a pass
    for data in quiet:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            keras_dp.fit_sharded(model, verbose=0, devices=devices(3), **data)


def test_callbacks_see_a_tf_data_datasets_length_as_their_steps_as_in_model_fit():
    # Keras's fit passes the dataset's cardinality as params["steps"] (the
    # progress bar's total, a warm-up schedule's length); keras_dp passed None.
    class Params(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.seen = dict(self.params)

    x, y, dataset, model = three_batch_dataset_and_model()
    ours, theirs = Params(), Params()
    keras_dp.fit_sharded(model, dataset, verbose=0, devices=devices(3), callbacks=[ours])
    model.fit(dataset, verbose=0, callbacks=[theirs])
    assert ours.seen == theirs.seen == {"verbose": 0, "epochs": 1, "steps": 3}
    unknown = dataset.filter(lambda features, label: True)  # tf.data cannot count it
    keras_dp.fit_sharded(model, unknown, verbose=0, devices=devices(3), callbacks=[ours])
    assert ours.seen["steps"] is None  # as Keras's: checked by hand


@pytest.mark.parametrize("key", ["cat", 1.5])
def test_a_class_weight_key_that_is_not_a_class_id_is_refused_before_any_step(key):
    # Keras's fit looks each label up as class_weight.get(int(label)): a key
    # "cat" or 1.5 never matches and is dropped silently. keras_dp failed with
    # "invalid literal for int() with base 10: 'cat'", and cut 1.5 to class 1.
    import re

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(12, 4)).astype("float32"), rng.integers(0, 3, 12)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match=r"`class_weight` maps integer class ids to weights.*"
                       rf"Received the key {re.escape(repr(key))} \(of type "
                       rf"{type(key).__name__}\).*StringLookup") as raised:
        keras_dp.fit_sharded(model, x, y, class_weight={0: 1.0, key: 2.0}, verbose=0,
                             devices=devices(2))
    assert raised.value.__context__ is None and int(model.optimizer.iterations) == 0
    # A dataset's keys are checked once, when it is wrapped, before any batch is read.
    read = []
    batches = (read.append(index) or (x, y) for index in range(2))
    with pytest.raises(ValueError, match="Received the key"):
        keras_dp.fit_sharded(model, batches, class_weight={key: 2.0}, verbose=0,
                             devices=devices(2))
    assert read == [] and int(model.optimizer.iterations) == 0


def test_class_weight_keyed_by_integral_floats_weights_those_classes():
    # np.unique of float or bool labels gives such keys: 1.0 and True are
    # class 1, as in Keras's class_weight.get(int(label)).
    y = np.array([0, 1, 2, 1])
    for class_weight in ({0.0: 1.0, np.float64(1.0): 3.0}, {False: 1.0, np.True_: 3.0}):
        _, _, weights = keras_dp.sources.batch.apply_class_weight((None, y, None), class_weight)
        np.testing.assert_array_equal(weights, [1.0, 3.0, 1.0, 3.0])


def test_a_model_that_turns_off_jit_keeps_its_own_errors():
    # With a supports_jit=False layer in the model, every failure in a step
    # was rewritten as "the compiled step failed to trace ... do that
    # augmentation in the input pipeline": an error of the running step
    # (out of memory) too; and an error with an empty message became
    # "IndexError: list index out of range".
    # Named: Keras numbers a default name after the layers made before it in the process.
    model = keras.Sequential([keras.Input((28, 28, 1)),
                              keras.layers.RandomRotation(0.1, name="random_rotation"),
                              keras.layers.Flatten(), keras.layers.Dense(10)])
    out_of_memory = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory")
    with pytest.raises(jax.errors.JaxRuntimeError) as raised:
        raise explain.jit_failure(out_of_memory, model) or out_of_memory
    assert raised.value is out_of_memory
    with pytest.raises(ValueError, match=r"supports_jit=False: random_rotation .*"
                       r"failed to trace: AssertionError: AssertionError Do that"):
        error = AssertionError()
        raise explain.jit_failure(error, model) or error
