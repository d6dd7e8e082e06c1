"""keras.io examples as users adapt them: `fit_sharded` in place of `model.fit`.

Each case trains on 3 devices with a global batch that 3 does not divide and
a partial last batch, `shuffle=False`, from the seed and initial weights of
Keras's own `model.fit` on one device: every log (`val_*` included) within
rtol 1e-5, every weight within 1e-5 of its variable's largest entry, and
`predict` within 1e-5 of the output's. The examples that matched Keras and
checked nothing the other test files do are listed in README ("keras.io
examples") with their measured differences, not kept here.
"""

import keras
import numpy as np
import pytest
from keras import layers
from keras import ops

import keras_dp
from conftest import assert_close_to_scale, assert_weights_close
from conftest import devices

BATCH = 16  # 6, 5 and 5 rows per device


def assert_fit_equals_keras(build, fit_args, fit_kwargs, variables=True):
    """`fit_sharded` on 3 devices equals `model.fit` on one; returns both models."""
    reference = build()
    expected = reference.fit(*fit_args(), **fit_kwargs()).history
    model = build()
    got = keras_dp.fit_sharded(model, *fit_args(), devices=devices(3), **fit_kwargs()).history
    assert sorted(got) == sorted(expected)
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-5, err_msg=key)
    if variables:
        assert_weights_close(model, reference)
    return model, reference, got


# -- Siamese network with a contrastive loss (keras.io "siamese_contrastive") --

def euclidean_distance(vectors):
    left, right = vectors
    sum_square = ops.sum(ops.square(left - right), axis=1, keepdims=True)
    return ops.sqrt(ops.maximum(sum_square, keras.backend.epsilon()))


def contrastive(margin=1):
    def contrastive_loss(y_true, y_pred):
        square_pred = ops.square(y_pred)
        margin_square = ops.square(ops.maximum(margin - y_pred, 0))
        return ops.mean((1 - y_true) * square_pred + y_true * margin_square)
    return contrastive_loss


def siamese():
    keras.utils.set_random_seed(0)
    image = layers.Input((6, 6, 1))
    tower = keras.Model(image, layers.Dense(5, activation="tanh")(layers.Flatten()(image)))
    left, right = layers.Input((6, 6, 1)), layers.Input((6, 6, 1))
    distance = layers.Lambda(euclidean_distance, output_shape=(1,))([tower(left), tower(right)])
    output = layers.Dense(1, activation="sigmoid")(layers.BatchNormalization()(distance))
    model = keras.Model([left, right], output)
    model.compile(loss=contrastive(margin=1), optimizer="RMSprop", metrics=["accuracy"])
    return model


def pairs(rows=50):
    rng = np.random.default_rng(0)
    left, right = (rng.uniform(size=(rows, 6, 6, 1)).astype("float32") for _ in range(2))
    return left, right, rng.integers(0, 2, rows).astype("float32")


@pytest.mark.slow  # 7 s; tuples of inputs are read as model.fit reads them in test_models_and_inputs.py
def test_a_tuple_of_inputs_predicts_as_model_predict_reads_it():
    # keras.io's Siamese model takes two images; `fit((left, right), y)`
    # trained, but `predict((left, right))`, which Keras reads as the model's
    # two inputs, was read as a packed (x, y): it fed `left` alone and failed
    # to build ("expects 2 named input(s) ... but it received 1"), and so did
    # `validation_data=[(left, right), y]`, a list Keras reads as [x, y],
    # taken for a list of batches since it holds a tuple. A tuple with one
    # array per input of the model is now its inputs; for a one-input model
    # a tuple is still `(x, y[, sample_weight])`.
    left, right, y = pairs()
    fit = lambda: ((left[:40], right[:40]), y[:40])  # noqa: E731; last batch 8
    options = lambda: dict(batch_size=BATCH, epochs=2, shuffle=False, verbose=0,  # noqa: E731
                           validation_data=[(left[40:], right[40:]), y[40:]])
    model, reference, _ = assert_fit_equals_keras(siamese, fit, options)
    trainer = keras_dp.ShardedTrainer(model, devices=devices(3))
    expected = reference.predict((left, right), batch_size=BATCH, verbose=0)  # last batch 2
    assert_close_to_scale(trainer.predict((left, right), batch_size=BATCH, verbose=0), expected)
    assert_close_to_scale(trainer.predict([left, right], batch_size=BATCH, verbose=0), expected)
    one_input = keras.Sequential([keras.Input((6, 6, 1)), layers.Flatten(), layers.Dense(2)])
    packed = keras_dp.ShardedTrainer(one_input, devices=devices(3)).predict(
        (left, y), batch_size=BATCH, verbose=0)  # (x, y): the labels are not read
    assert_close_to_scale(packed, one_input.predict(left, batch_size=BATCH, verbose=0))


class TwoTower(keras.Model):
    """A subclassed model taking a tuple of two arrays: Keras cannot count its inputs."""

    def __init__(self):
        super().__init__()
        self.dense = layers.Dense(2)

    def call(self, inputs):
        left, right = inputs
        return self.dense(ops.concatenate([left, right], axis=-1))


def test_a_subclassed_model_predicts_a_tuple_as_its_inputs_as_keras_does():
    # `model.predict((left, right))` hands a subclassed model the whole tuple;
    # keras_dp read it as a packed (x, y), fed `left` alone, and failed to
    # build ("too many values to unpack"), though `fit((left, right), y)` trained.
    rng = np.random.default_rng(2)
    left, right = rng.normal(size=(2, 37, 3)).astype("float32")
    y = rng.integers(0, 2, 37)
    model = TwoTower()
    model.compile(optimizer="sgd",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    trainer = keras_dp.ShardedTrainer(model, devices=devices(3))
    trainer.fit((left, right), y, batch_size=BATCH, epochs=1, verbose=0)
    got = trainer.predict((left, right), batch_size=BATCH, verbose=0)  # last batch 5
    assert got.shape == (37, 2)
    assert_close_to_scale(got, model.predict((left, right), batch_size=BATCH, verbose=0))


def two_input_classifier():
    left, right = keras.Input((3,)), keras.Input((3,))
    model = keras.Model([left, right], layers.Dense(2)(layers.Concatenate()([left, right])))
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_an_ensembles_predict_reads_a_tuple_of_inputs_as_the_inputs():
    rng = np.random.default_rng(1)
    left, right = rng.normal(size=(2, 11, 3)).astype("float32")
    trainer = keras_dp.EnsembleTrainer(two_input_classifier, devices=devices(2))
    got = trainer.predict_members((left, right), batch_size=4, verbose=0)
    for member, probabilities in zip(trainer.members, got, strict=True):
        expected = ops.convert_to_numpy(ops.softmax(member.predict([left, right], verbose=0)))
        assert_close_to_scale(probabilities, expected)


# -- Collaborative filtering (keras.io "collaborative_filtering_movielens") ----

class RecommenderNet(keras.Model):
    """keras.io's model as written: `ops.tensordot(users, movies, 2)` sums over
    the batch too, so each row's output depends on every row of its batch."""

    def __init__(self, users, movies, size):
        super().__init__()
        self.user_embedding = layers.Embedding(
            users, size, embeddings_initializer="he_normal",
            embeddings_regularizer=keras.regularizers.l2(1e-6))
        self.user_bias = layers.Embedding(users, 1)
        self.movie_embedding = layers.Embedding(
            movies, size, embeddings_initializer="he_normal",
            embeddings_regularizer=keras.regularizers.l2(1e-6))
        self.movie_bias = layers.Embedding(movies, 1)

    def call(self, inputs):
        user_vector = self.user_embedding(inputs[:, 0])
        movie_vector = self.movie_embedding(inputs[:, 1])
        dot_user_movie = ops.tensordot(user_vector, movie_vector, 2)
        x = dot_user_movie + self.user_bias(inputs[:, 0]) + self.movie_bias(inputs[:, 1])
        return ops.nn.sigmoid(x)


def recommender():
    keras.utils.set_random_seed(0)
    model = RecommenderNet(7, 9, 4)
    model.compile(loss=keras.losses.BinaryCrossentropy(),
                  optimizer=keras.optimizers.Adam(learning_rate=0.01))
    return model


def test_a_model_that_mixes_the_rows_of_its_batch_predicts_from_the_real_rows_only():
    # What no other test checks: an inference-mode output that depends on the
    # other rows of its batch. The last batch of 11 rows is padded to 12 to
    # split over 3 devices; a padded row reaching the tensordot would shift
    # every prediction of that batch. (N, 2) int64 (user, item) pairs and a
    # float64 rating, as keras.io reads them from pandas.
    rng = np.random.default_rng(0)
    x = np.stack([rng.integers(0, 7, 59), rng.integers(0, 9, 59)], 1)
    y = rng.uniform(0, 1, 59)
    fit = lambda: (x[:43], y[:43])  # noqa: E731; batches of 16, 16 and 11
    options = lambda: dict(batch_size=BATCH, epochs=2, shuffle=False, verbose=0,  # noqa: E731
                           validation_data=(x[43:], y[43:]))
    model, reference, _ = assert_fit_equals_keras(recommender, fit, options)
    expected = reference.predict(x, batch_size=BATCH, verbose=0)
    got = keras_dp.ShardedTrainer(model, devices=devices(3)).predict(x, batch_size=BATCH, verbose=0)
    assert_close_to_scale(got, expected)
    # The check has teeth: one extra row in the last batch moves its outputs.
    moved = reference.predict(np.concatenate([x, x[-1:]]), batch_size=BATCH, verbose=0)[48:59]
    assert np.max(np.abs(moved - expected[48:])) > 1e-3


# -- Timeseries classification from scratch (keras.io) ------------------------

def timeseries_classifier():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((20, 1))
    hidden = inputs
    for _ in range(3):
        # keras.io's Conv1D has a bias, which the BatchNormalization after it
        # cancels: its gradient is rounding noise, which Adam turns into
        # +-lr steps, different on any two programs (conftest's NO_GRADIENT).
        hidden = layers.Conv1D(8, 3, padding="same", use_bias=False)(hidden)
        hidden = layers.ReLU()(layers.BatchNormalization()(hidden))
    outputs = layers.Dense(2, activation="softmax")(layers.GlobalAveragePooling1D()(hidden))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                  metrics=["sparse_categorical_accuracy"])
    return model


@pytest.mark.slow  # 8 s on the shared 2-core VM
def test_three_callbacks_on_the_val_loss_of_a_validation_split_act_as_under_keras(tmp_path):
    # What no other test checks: ModelCheckpoint(save_best_only),
    # ReduceLROnPlateau and EarlyStopping together on the `val_loss` of a
    # `validation_split`, against Keras: the rate halves after the same
    # epochs, training stops after the same one, and the best file holds the
    # best epoch's weights as Keras's does.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(110, 20, 1)).astype("float32")  # 88 rows train: 5 x 16, then 8
    y = (x[:, :10, 0].mean(1) > 0).astype("int64")
    files = iter([tmp_path / "keras.keras", tmp_path / "ours.keras"])

    def options():
        return dict(batch_size=BATCH, epochs=12, shuffle=False, verbose=0, validation_split=0.2,
                    callbacks=[
                        keras.callbacks.ModelCheckpoint(next(files), save_best_only=True),
                        keras.callbacks.ReduceLROnPlateau(factor=0.5, patience=1, min_lr=1e-4,
                                                          min_delta=0.008),
                        keras.callbacks.EarlyStopping(patience=3, min_delta=0.008)])

    model, reference, history = assert_fit_equals_keras(timeseries_classifier, lambda: (x, y),
                                                        options)
    assert len(history["loss"]) == 6  # stopped early
    np.testing.assert_allclose(history["learning_rate"], [1e-3, 1e-3, 5e-4, 5e-4, 2.5e-4, 1.25e-4])
    assert_weights_close(keras.models.load_model(tmp_path / "ours.keras"),
                         keras.models.load_model(tmp_path / "keras.keras"))



# -- Timeseries forecasting (keras.io "timeseries_weather_forecasting") --------

def forecaster():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4, 2))
    # keras.io's LSTM, as a Dense on the window: the orders are what is tested.
    model = keras.Model(inputs, layers.Dense(1)(layers.Flatten()(inputs)))
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    return model


def test_a_reshuffling_dataset_fit_twice_and_predicted_reads_kerass_orders():
    # `timeseries_dataset_from_array(shuffle=True, seed=...)` reshuffles at
    # each iterator made. Keras's fit makes one per epoch, plus one for a
    # first batch only while the model, its compiled loss or metrics are
    # unbuilt; its predict, only while a layer is. keras_dp made that extra
    # one at every call: a second fit on the same dataset (training on) read
    # every epoch in the order after Keras's (losses 0.04 apart before), and
    # `predict` returned its rows in another order than Keras's.
    series = np.random.default_rng(0).normal(size=(60, 2)).astype("float32")

    def data():
        return keras.utils.timeseries_dataset_from_array(
            series[:-4], series[4:, :1], sequence_length=4, batch_size=8, shuffle=True, seed=1)

    results = {}
    for side in ("keras", "keras_dp"):
        model, dataset = forecaster(), data()  # each side its own iterators
        if side == "keras":
            histories = [model.fit(dataset, epochs=2, verbose=0).history for _ in range(2)]
            predicted = model.predict(dataset, verbose=0)
        else:
            histories = [keras_dp.fit_sharded(model, dataset, epochs=2, verbose=0,
                                              devices=devices(3)).history for _ in range(2)]
            predicted = keras_dp.ShardedTrainer(model, devices=devices(3)).predict(dataset,
                                                                                  verbose=0)
        results[side] = model, histories, predicted
    (reference, expected, expected_predicted), (model, got, predicted) = results.values()
    for ours, theirs in zip(got, expected, strict=True):  # batches of 8 and a last of 1
        for key in theirs:
            np.testing.assert_allclose(ours[key], theirs[key], rtol=1e-5, err_msg=key)
    assert_weights_close(model, reference)
    assert_close_to_scale(predicted, expected_predicted)
