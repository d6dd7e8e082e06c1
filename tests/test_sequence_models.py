"""Sequence, text and attention models, as a user brings them.

The parity tests compare keras_dp on 2 or 3 simulated devices with Keras's
`model.fit`, `evaluate` and `predict` on one device from the same initial
weights (on 3 devices, batches of 16 rows, which do not divide by 3); text
layers that JAX cannot compile, and text data, are refused before anything
runs, with the fix.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers

import keras_dp
from conftest import assert_close_to_scale, devices

ROWS, STEPS, VOCAB, BATCH = 48, 7, 20, 16  # 3 batches of 16: 6, 5 and 5 rows on 3 devices


def padded_tokens(rows=ROWS):
    """Token ids in [1, VOCAB) padded with 0 to STEPS, and each row's length."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, STEPS + 1, rows)
    tokens = np.zeros((rows, STEPS), "int32")
    for row, length in enumerate(lengths):
        tokens[row, :length] = rng.integers(1, VOCAB, length)
    return tokens, lengths


def twins(build):
    """Two models from `build` with the same initial weights and Dropout seeds."""
    keras.utils.set_random_seed(0)
    reference = build()
    keras.utils.set_random_seed(0)  # a SeedGenerator's state is not a weight
    model = build()
    model.set_weights(reference.get_weights())
    return reference, model


def assert_matches_keras(build, x, y, num_devices, sample_weight=None):
    """fit (2 epochs), evaluate and predict equal Keras's on one device."""
    reference, model = twins(build)
    kwargs = dict(batch_size=BATCH, epochs=2, shuffle=False, verbose=0, sample_weight=sample_weight)
    expected = reference.fit(x, y, **kwargs).history
    history = keras_dp.fit_sharded(model, x, y, devices=devices(num_devices), **kwargs).history
    assert history.keys() == expected.keys()
    for name in expected:
        np.testing.assert_allclose(history[name], expected[name], rtol=1e-5, err_msg=name)
    trainer = keras_dp.ShardedTrainer(reference, devices=devices(num_devices))
    np.testing.assert_allclose(
        trainer.evaluate(x, y, batch_size=BATCH, sample_weight=sample_weight, verbose=0),
        reference.evaluate(x, y, batch_size=BATCH, sample_weight=sample_weight, verbose=0),
        rtol=1e-5)
    predicted = trainer.predict(x, batch_size=BATCH, verbose=0)
    assert_close_to_scale(predicted, reference.predict(x, batch_size=BATCH, verbose=0))


def tagger():
    """A masked embedding, a Transformer block (causal attention over the padding
    mask, Dropout, LayerNormalization), a bidirectional LSTM and a per-timestep
    binary output scored by AUC, Precision and Recall."""
    tokens = keras.Input((STEPS,), dtype="int32")
    embedded = layers.Embedding(VOCAB, 8, mask_zero=True)(tokens)
    attended = layers.MultiHeadAttention(2, 4, dropout=0.1)(
        embedded, embedded, use_causal_mask=True)
    hidden = layers.LayerNormalization()(embedded + layers.Dropout(0.2)(attended))
    hidden = layers.Bidirectional(layers.LSTM(4, return_sequences=True))(hidden)
    model = keras.Model(tokens, layers.Dense(1, activation="sigmoid")(hidden))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="binary_crossentropy", metrics=[
        keras.metrics.AUC(name="auc"), keras.metrics.Precision(name="precision"),
        keras.metrics.Recall(name="recall")])
    return model


@pytest.mark.slow  # 20-30 s on the 2-core VM: 8 compilations of attention and an LSTM
def test_a_masked_transformer_and_lstm_tagger_with_temporal_weights_equals_keras():
    # The mask reaches attention, the LSTM, every timestep's loss and the
    # metrics; the (rows, steps) sample weights weigh each timestep; 3 devices
    # split each batch of 16 rows 6, 5 and 5.
    tokens, _ = padded_tokens()
    weights = (tokens > 0) * np.linspace(0.5, 1.5, STEPS, dtype="float32")
    labels = (tokens % 2)[..., None].astype("float32")
    assert_matches_keras(tagger, tokens, labels, num_devices=3, sample_weight=weights)


# -- Text ---------------------------------------------------------------------

WORDS = "the cat sat on a mat dog ran far away big small red blue".split()


def sentences(rows=20):
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(WORDS, rng.integers(1, 12))) for _ in range(rows)]
    return texts, np.array(["cat" in text for text in texts], "int32")


@pytest.mark.slow
def test_a_tf_data_text_pipeline_of_padded_batches_equals_keras():
    # StringLookup maps the words in the pipeline; padded_batch pads each batch
    # to its own longest sentence, and each new shape is compiled once, as
    # under Keras: 5 batches, 3 shapes, 3 compilations over 2 epochs.
    texts, labels = sentences()
    lookup = layers.StringLookup(vocabulary=WORDS)

    def dataset():
        pairs = tf.data.Dataset.from_tensor_slices((texts, labels))
        return pairs.map(lambda text, label: (lookup(tf.strings.split(text)), label)).padded_batch(4)

    shapes = {tuple(tokens.shape) for tokens, _ in dataset()}
    assert len(shapes) == 3, shapes

    def build():
        model = keras.Sequential([
            keras.Input((None,), dtype="int64"),
            layers.Embedding(lookup.vocabulary_size(), 8, mask_zero=True),
            layers.GlobalAveragePooling1D(), layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    reference, model = twins(build)
    expected = reference.fit(dataset(), epochs=2, shuffle=False, verbose=0).history
    trainer = keras_dp.ShardedTrainer(model, devices=devices(2))
    history = trainer.fit(dataset(), epochs=2, verbose=0).history
    for name in expected:
        np.testing.assert_allclose(history[name], expected[name], rtol=1e-5, err_msg=name)
    assert trainer.programs.train_step._cache_size() == 3


@pytest.mark.slow  # 5 s: moved out of CI to keep the default run under 10 minutes
def test_ragged_batches_of_split_text_are_padded_as_keras_pads_them():
    # Splitting a batch of strings gives a RaggedTensor; Keras pads it with
    # zeros to the longest row. keras_dp refused it ("dtype object").
    texts, labels = sentences()
    lookup = layers.StringLookup(vocabulary=WORDS)

    def dataset():
        batches = tf.data.Dataset.from_tensor_slices((texts, labels)).batch(8)
        return batches.map(lambda text, label: (lookup(tf.strings.split(text)), label))

    assert isinstance(next(iter(dataset()))[0], tf.RaggedTensor)

    def build():
        model = keras.Sequential([
            keras.Input((None,), dtype="int64"),
            layers.Embedding(lookup.vocabulary_size(), 8, mask_zero=True),
            layers.GlobalAveragePooling1D(), layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    reference, model = twins(build)
    expected = reference.fit(dataset(), epochs=2, shuffle=False, verbose=0).history["loss"]
    trainer = keras_dp.ShardedTrainer(model, devices=devices(3))
    np.testing.assert_allclose(trainer.fit(dataset(), epochs=2, verbose=0).history["loss"],
                               expected, rtol=1e-5)
    assert_close_to_scale(trainer.predict(dataset(), verbose=0),
                          reference.predict(dataset(), verbose=0))


def string_classifier():
    vectorize = layers.TextVectorization(max_tokens=30, output_sequence_length=8)
    vectorize.adapt(WORDS)
    return keras.Sequential([keras.Input((), dtype="string"), vectorize,
                             layers.Embedding(30, 8), layers.GRU(4), layers.Dense(2)])


def token_classifier():
    return keras.Sequential([keras.Input((5,), dtype="int32"),
                             layers.IntegerLookup(vocabulary=np.arange(1, 40)),
                             layers.Embedding(41, 4), layers.GlobalAveragePooling1D(),
                             layers.Dense(2)])


@pytest.mark.parametrize("build, name", [(string_classifier, "TextVectorization"),
                                         (token_classifier, "IntegerLookup")])
def test_a_tensorflow_text_layer_inside_the_model_is_refused_with_the_fix(build, name):
    # JAX cannot compile their TensorFlow ops (Keras's model.fit on JAX fails
    # on them too): refused when the trainer is made, naming the layer and the
    # fix, without the warning about un-jitted layers first.
    model = build()
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match=rf"\({name}\)\. Move them into the tf\.data "
                           r"pipeline") as raised:
            keras_dp.ShardedTrainer(model, devices=devices(2))
    assert raised.value.__cause__ is None and raised.value.__context__ is None
    assert str(raised.value).count("Lookup") == (name == "IntegerLookup")  # not its inner lookup


@pytest.mark.parametrize("source", ["arrays", "tf.data"])
def test_text_data_is_refused_with_the_fix(source):
    texts, labels = sentences(4)
    model = keras.Sequential([keras.Input((8,)), layers.Dense(2)])
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    data = (np.array(texts), labels) if source == "arrays" else (
        tf.data.Dataset.from_tensor_slices((texts, labels)).batch(2),)
    with pytest.raises(ValueError, match=r"holding text; .*keras.layers.TextVectorization"):
        keras_dp.fit_sharded(model, *data, batch_size=2 if source == "arrays" else None,
                             verbose=0, devices=devices(2))


def masked_rnn():
    model = keras.Sequential([keras.Input((STEPS,), dtype="int32"),
                              layers.Embedding(VOCAB, 8, mask_zero=True), layers.SimpleRNN(4),
                              layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.slow
def test_an_ensemble_of_recurrent_members_equals_each_trained_alone():
    # The RNN's scan starts from a constant zero state: shard_map's check of
    # varying values refused to trace it (TypeError, "carry ... differ").
    tokens, lengths = padded_tokens()
    labels = (lengths > 3).astype("int32")
    trainer = keras_dp.EnsembleTrainer(masked_rnn, 2, devices=devices(2))
    trainer.fit(tokens, labels, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    probabilities = trainer.predict_members(tokens, batch_size=BATCH)
    for i, member in enumerate(trainer.members):
        keras.utils.set_random_seed(i)
        alone = masked_rnn()
        expected = alone.fit(tokens, labels, batch_size=BATCH, epochs=2, shuffle=False,
                             verbose=0).history["loss"]
        np.testing.assert_allclose([epoch[i] for epoch in trainer.member_history["loss"]],
                                   expected, rtol=1e-5)
        for ours, theirs in zip(member.get_weights(), alone.get_weights()):
            np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6 * np.abs(theirs).max())
        assert_close_to_scale(probabilities[i], keras.ops.softmax(member(tokens)))


def test_predict_ignores_labels_that_do_not_fit_the_loss_as_keras_does():
    # A labelled dataset given to predict: Keras reads x only. keras_dp checked
    # the labels against the loss and refused ("The labels do not fit").
    tokens, lengths = padded_tokens()
    model = keras.Sequential([keras.Input((STEPS,), dtype="int32"),
                              layers.Embedding(VOCAB, 4), layers.Dense(2)])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy())
    dataset = tf.data.Dataset.from_tensor_slices((tokens, lengths)).batch(BATCH)
    predicted = keras_dp.ShardedTrainer(model, devices=devices(3)).predict(dataset, verbose=0)
    assert_close_to_scale(predicted, model.predict(dataset, verbose=0))


def test_per_timestep_predictions_of_batches_padded_to_different_lengths_are_refused():
    tokens, _ = padded_tokens()
    model = keras.Sequential([keras.Input((None,), dtype="int32"),
                              layers.Embedding(VOCAB, 4), layers.Dense(2)])
    batches = (batch for batch in [tokens[:16], tokens[16:32, :5]])  # (16, 7), (16, 5)
    trainer = keras_dp.ShardedTrainer(model, devices=devices(2))
    with pytest.raises(ValueError, match=r"different shapes after the rows \(\(5, 2\), \(7, 2\)\)"
                       r".*Pad every batch to one length") as raised:
        trainer.predict(batches, verbose=0)
    assert raised.value.__context__ is None


def test_row_weights_on_a_per_timestep_loss_are_refused_with_the_repeat_fix():
    # One weight per row for a per-timestep (and masked) loss: Keras's fit
    # fails with "Incompatible shapes for broadcasting: shapes=[(16, 7),
    # (16,)]"; keras_dp said "Give one weight per row", as given. The fix it
    # names now trains as Keras does.
    tokens, _ = padded_tokens()
    labels = tokens % 3
    row_weights = np.linspace(0.5, 2.0, ROWS).astype("float32")

    def build():
        model = keras.Sequential([keras.Input((STEPS,), dtype="int32"),
                                  layers.Embedding(VOCAB, 4, mask_zero=True), layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    reference, model = twins(build)
    kwargs = dict(batch_size=BATCH, shuffle=False, verbose=0)
    with pytest.raises(ValueError, match=(
            r"sample weights \(shape \(16,\)\) do not fit .*The loss is per timestep.*"
            r"sample_weight=np\.repeat\(weights\[:, None\], 7, axis=1\), of shape \(rows, 7\)")) as raised:
        keras_dp.fit_sharded(model, tokens, labels, sample_weight=row_weights,
                             devices=devices(2), **kwargs)
    assert "Give one weight per row" not in str(raised.value)
    weights = np.repeat(row_weights[:, None], STEPS, axis=1)
    np.testing.assert_allclose(
        keras_dp.fit_sharded(model, tokens, labels, sample_weight=weights, devices=devices(2),
                             **kwargs).history["loss"],
        reference.fit(tokens, labels, sample_weight=weights, **kwargs).history["loss"], rtol=1e-5)


def test_class_weight_on_per_timestep_labels_is_refused_with_the_sample_weight_fix():
    # class_weight gives one weight per row (as in Keras, which fails with
    # "Incompatible shapes for broadcasting"); keras_dp said "the labels do not
    # fit", though they do. The fix it names trains as Keras does.
    tokens, _ = padded_tokens()
    labels, class_weight = tokens % 3, {0: 0.5, 2: 2.0}

    def build():
        model = keras.Sequential([keras.Input((STEPS,), dtype="int32"),
                                  layers.Embedding(VOCAB, 4), layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    reference, model = twins(build)
    kwargs = dict(batch_size=BATCH, shuffle=False, verbose=0)
    with pytest.raises(ValueError, match=r"labels fit the model's output, but the sample weights "
                       r"\(shape \(16,\)\) do not fit .*np\.vectorize") as raised:
        keras_dp.fit_sharded(model, tokens, labels, class_weight=class_weight,
                             devices=devices(3), **kwargs)
    assert raised.value.__suppress_context__  # no chain of Keras's internals
    weights = np.vectorize(lambda c: class_weight.get(c, 1.0))(labels)
    np.testing.assert_allclose(
        keras_dp.fit_sharded(model, tokens, labels, sample_weight=weights, devices=devices(3),
                             **kwargs).history["loss"],
        reference.fit(tokens, labels, sample_weight=weights, **kwargs).history["loss"], rtol=1e-5)
