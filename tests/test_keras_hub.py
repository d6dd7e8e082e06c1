"""keras_hub models, as users bring them, trained by keras_dp against Keras's `model.fit`.

Tiny configs built from the constructors (no presets: no download), on
random token ids and images, 26 rows in batches of 8 on 3 devices (each
batch split 3, 3 and 2, the last batch of 2 rows). Skipped where keras_hub
is not installed (it is not a dependency of keras_dp).
"""

import keras
import numpy as np
import pytest

import keras_dp
from conftest import devices

keras_hub = pytest.importorskip(
    "keras_hub", reason="keras_hub is not installed: it is not in the [test] extra (it would "
    "bring full TensorFlow beside tensorflow-cpu); pip install --no-deps keras-hub==0.32.0 "
    "regex tokenizers (docs/testing.md)")
tf = pytest.importorskip("tensorflow")

ROWS, BATCH, VOCAB, LENGTH = 26, 8, 100, 12


def tokens():
    """Token ids padded with 0 after each row's length, and the padding mask."""
    rng = np.random.default_rng(0)
    mask = (np.arange(LENGTH)[None] < rng.integers(4, LENGTH + 1, ROWS)[:, None]).astype("int32")
    return rng.integers(1, VOCAB, (ROWS, LENGTH)).astype("int32") * mask, mask


def bert():
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32,
        max_sequence_length=16, dropout=0.1)
    model = keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=3, preprocessor=None)
    ids, mask = tokens()
    x = {"token_ids": ids, "padding_mask": mask, "segment_ids": np.zeros_like(ids)}
    return model, x, np.arange(ROWS) % 3, None


def causal_lm(kind):
    def build():
        if kind == "gpt2":
            backbone = keras_hub.models.GPT2Backbone(
                vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=16,
                intermediate_dim=32, max_sequence_length=16, dropout=0.0)
            model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
        else:
            backbone = keras_hub.models.GemmaBackbone(
                vocabulary_size=VOCAB, num_layers=2, num_query_heads=2, num_key_value_heads=1,
                hidden_dim=16, intermediate_dim=32, head_dim=8, dropout=0.0)
            model = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
        ids, mask = tokens()  # the next token is the label; the padding is weighted 0
        return (model, {"token_ids": ids, "padding_mask": mask}, np.roll(ids, -1, axis=1),
                mask.astype("float32"))
    return build


def twins(build):
    """Two tasks from `build` with the same initial weights and seed state, and the data."""
    keras.utils.set_random_seed(0)
    reference, x, y, sample_weight = build()
    keras.utils.set_random_seed(0)
    model = build()[0]
    model.set_weights(reference.get_weights())
    return reference, model, x, y, sample_weight


def assert_weights_match(model, reference):
    """Every weight within 1e-5 of its variable's largest entry, but attention's
    key biases: a softmax ignores a shift shared by all keys, so their gradient
    is 0 and their values are rounding noise (Adam makes it step-sized)."""
    for variable, got, expected in zip(model.weights, model.get_weights(),
                                       reference.get_weights(), strict=True):
        if not variable.path.endswith("key/bias"):
            np.testing.assert_allclose(got, expected, rtol=0, err_msg=variable.path,
                                       atol=1e-5 * np.abs(expected).max())


@pytest.mark.slow  # 27-35 s each on the 2-core VM, shared: transformers compile slowly
@pytest.mark.parametrize("build", [bert, causal_lm("gpt2"), causal_lm("gemma")],
                         ids=["bert-dropout", "gpt2", "gemma"])
def test_keras_hub_text_tasks_train_evaluate_and_predict_as_keras_fit_on_one_device(build):
    # Each task's own compile (Adam, sparse categorical cross-entropy from
    # logits, weighted accuracy), dict inputs, a padding mask; BERT with its
    # Dropouts active, the causal LMs with per-token sample weights.
    reference, model, x, y, sample_weight = twins(build)
    kwargs = dict(batch_size=BATCH, epochs=2, shuffle=False, verbose=0, sample_weight=sample_weight)
    expected = reference.fit(x, y, **kwargs).history
    history = keras_dp.fit_sharded(model, x, y, devices=devices(3), **kwargs).history
    assert history.keys() == expected.keys()
    for name in expected:
        np.testing.assert_allclose(history[name], expected[name], rtol=1e-5, err_msg=name)
    assert_weights_match(model, reference)
    trainer = keras_dp.ShardedTrainer(reference, devices=devices(3))
    np.testing.assert_allclose(
        trainer.evaluate(x, y, batch_size=BATCH, sample_weight=sample_weight, verbose=0),
        reference.evaluate(x, y, batch_size=BATCH, sample_weight=sample_weight, verbose=0),
        rtol=1e-5)
    expected = reference.predict(x, batch_size=BATCH, verbose=0)
    np.testing.assert_allclose(trainer.predict(x, batch_size=BATCH, verbose=0), expected,
                               rtol=0, atol=1e-5 * np.abs(expected).max())


@pytest.mark.slow  # about 66 s on the 2-core VM, shared
def test_gpt2_with_a_split_state_and_two_steps_per_call_equals_keras_and_generates_the_same():
    reference, model, x, y, sample_weight = twins(causal_lm("gpt2"))
    kwargs = dict(batch_size=BATCH, epochs=2, shuffle=False, verbose=0, sample_weight=sample_weight)
    plan = keras_dp.memory_plan(model, x, y, batch_size=BATCH, sample_weight=sample_weight,
                                devices=devices(3), state_sharding="full")
    assert plan.devices == 3 and 0 < plan.weights < 4 * sum(
        v.numpy().nbytes for v in model.weights) / 3 + 1024
    expected = reference.fit(x, y, **kwargs).history
    history = keras_dp.fit_sharded(model, x, y, devices=devices(3), state_sharding="full",
                                   steps_per_execution=2, **kwargs).history
    for name in expected:
        np.testing.assert_allclose(history[name], expected[name], rtol=1e-5, err_msg=name)
    assert_weights_match(model, reference)
    prompt = {"token_ids": x["token_ids"][:2] * (np.arange(LENGTH) < 4),
              "padding_mask": np.broadcast_to(np.arange(LENGTH) < 4, (2, LENGTH))}
    generated = model.generate(prompt, max_length=LENGTH, stop_token_ids=None)
    np.testing.assert_array_equal(
        generated["token_ids"],
        reference.generate(prompt, max_length=LENGTH, stop_token_ids=None)["token_ids"])


def vit_with_preprocessor():
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.ViTBackbone(
        image_shape=(16, 16, 3), patch_size=4, num_layers=1, num_heads=2, hidden_dim=8,
        mlp_dim=16, dropout_rate=0.0, attention_dropout=0.0)
    converter = keras_hub.layers.ViTImageConverter(image_size=(16, 16), scale=1 / 255)
    preprocessor = keras_hub.models.ViTImageClassifierPreprocessor(image_converter=converter)
    return keras_hub.models.ViTImageClassifier(
        backbone=backbone, num_classes=3, preprocessor=preprocessor, dropout=0.0)


@pytest.mark.slow  # about 12 s on the 2-core VM; tests/test_errors.py has a fast twin
def test_a_keras_hub_task_with_a_preprocessor_is_refused_and_the_fix_equals_keras_fit():
    # Its own fit rescales the images (preprocess_samples); keras_dp trained
    # on the raw pixels before: epoch losses 1.7223 and 1.7108 against
    # Keras's 1.7270 and 1.7153, silently.
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (16, 16, 16, 3)).astype("float32")
    y = rng.integers(0, 3, 16)
    reference, model = vit_with_preprocessor(), vit_with_preprocessor()
    expected = reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    with pytest.raises(ValueError, match=r"\(ViTImageClassifier\) has a preprocessor "
                       r"\(ViTImageClassifierPreprocessor\).*model\.preprocessor = None"):
        keras_dp.fit_sharded(model, x, y, batch_size=8, devices=devices(2))
    preprocessor, model.preprocessor = model.preprocessor, None  # the fix the message gives
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8).map(preprocessor)
    history = keras_dp.fit_sharded(model, data, epochs=2, verbose=0, devices=devices(2)).history
    for name in expected:
        np.testing.assert_allclose(history[name], expected[name], rtol=1e-5, err_msg=name)
    assert_weights_match(model, reference)
    model.preprocessor = preprocessor
    expected = reference.predict(x, verbose=0)
    np.testing.assert_allclose(model.predict(x, verbose=0), expected, rtol=0,
                               atol=1e-5 * np.abs(expected).max())
