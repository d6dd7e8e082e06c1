"""Layers, weight handling and JAX interop, against Keras's `model.fit` on one device.

Each case trains 25 rows in batches of 10 (on 3 devices 4, 3 and 3 rows, and
a last batch of 5) for 2 epochs with `shuffle=False`, from the same initial
weights and seeds as Keras's own `fit`: the epoch logs within rtol 1e-5,
every variable within 1e-5 of its own largest entry (integer variables, a
seed generator's state or int8 kernels, equal), and `predict` within 1e-5
of the output's scale. Random layers draw the numbers Keras draws: the step
traces the whole global batch, and JAX's partitionable threefry gives the
same bits however its rows are split over the devices.
"""

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest
from keras import layers

import keras_dp
from conftest import devices

OPTIONS = dict(batch_size=10, epochs=2, shuffle=False, verbose=0)


def tabular(rows=25):
    rng = np.random.default_rng(0)
    return rng.normal(size=(rows, 6)).astype("float32"), rng.integers(0, 3, rows)


def images(rows=25):
    rng = np.random.default_rng(1)
    return rng.uniform(0, 255, size=(rows, 8, 8, 3)).astype("float32"), rng.integers(0, 3, rows)


def classifier(*hidden, shape=(6,), optimizer=lambda: keras.optimizers.SGD(0.5), prepare=None):
    """A `build()` of a seeded, compiled Sequential: `hidden` layer factories, then softmax."""
    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input(shape), *(make() for make in hidden),
                                  layers.Dense(3, activation="softmax")])
        if prepare is not None:
            prepare(model)
        model.compile(optimizer=optimizer(), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
        return model
    return build


def assert_close_to_keras_fit(build, data, device_count=3):
    """keras_dp on `device_count` devices equals Keras's fit and predict on one."""
    x, y = data
    reference = build()
    expected = reference.fit(x, y, **OPTIONS).history
    model = build()
    got = keras_dp.fit_sharded(model, x, y, devices=devices(device_count), **OPTIONS).history
    assert sorted(got) == sorted(expected)
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-5, err_msg=key)
    for ours, theirs in zip(model.variables, reference.variables, strict=True):
        assert_scaled_close(ours.value, theirs.value, ours.path)
    predicted = keras_dp.ShardedTrainer(model, devices=devices(device_count)).predict(
        x, batch_size=10, verbose=0)
    assert_scaled_close(predicted, reference.predict(x, batch_size=10, verbose=0), "predict")
    return model


def assert_scaled_close(actual, expected, name, k=1e-5):
    actual, expected = np.asarray(actual), np.asarray(expected)
    if not np.issubdtype(expected.dtype, np.floating):
        np.testing.assert_array_equal(actual, expected, err_msg=name)
        return
    np.testing.assert_allclose(actual, expected, rtol=1e-5,
                               atol=k * np.abs(expected).max(initial=0), err_msg=name)


class AssignsInCall(layers.Layer):
    """Counts its training calls and keeps a running max in non-trainable weights."""

    def build(self, shape):
        self.count = self.add_weight((), initializer="zeros", trainable=False)
        self.peak = self.add_weight((shape[-1],), initializer="zeros", trainable=False)
        self.kernel = self.add_weight((shape[-1], 4))

    def call(self, x, training=False):
        if training:
            self.count.assign(self.count + 1.0)
            self.peak.assign(keras.ops.maximum(self.peak, keras.ops.max(keras.ops.abs(x), 0)))
        return keras.ops.matmul(x / (1.0 + self.peak), self.kernel)


@keras.ops.custom_gradient
def clip_gradient(x):
    def grad(*args, upstream=None):
        return keras.ops.clip(args[0] if upstream is None else upstream, -0.01, 0.01)
    return x, grad


class JaxOps(layers.Layer):
    """`jax.numpy` directly, `jax.lax.stop_gradient` and `keras.ops.custom_gradient`."""

    def build(self, shape):
        self.kernel = self.add_weight((shape[-1], 5))

    def call(self, x):
        h = jnp.sin(jnp.einsum("bi,ij->bj", x, self.kernel.value))
        return clip_gradient(h) + jax.lax.stop_gradient(2.0 * h) + jnp.mean(x, 0)[:5]


def jax_call(params, state, rng, inputs, training):
    """A `JaxLayer` function with params, state and dropout."""
    h = inputs @ params["w"]
    if training:
        h = h * jax.random.bernoulli(rng, 0.7, h.shape) / 0.7
        state = {"steps": state["steps"] + 1.0, "mean": 0.9 * state["mean"] + 0.1 * h.mean(0)}
    return h - state["mean"], state


def jax_init(rng, inputs, training):
    return ({"w": jax.random.normal(rng, (inputs.shape[-1], 5))},
            {"steps": jnp.zeros(()), "mean": jnp.zeros(5)})


def conv_head():
    return [lambda: layers.Rescaling(1 / 255.0), lambda: layers.Conv2D(4, 3, activation="relu"),
            layers.GlobalAveragePooling2D]


def preprocessing_inside():
    """Rescaling, Normalization adapted on the data, four random augmentations and Resizing.

    RandomRotation and RandomZoom set `supports_jit=False`, so Keras's fit
    would run un-jitted (rounding apart); this model, like keras_dp, is jitted.
    """
    keras.utils.set_random_seed(0)
    normalization = layers.Normalization()
    normalization.adapt(images()[0] / 255.0)
    model = keras.Sequential([
        keras.Input((8, 8, 3)), layers.Rescaling(1 / 255.0), normalization,
        layers.RandomFlip(seed=1), layers.RandomRotation(0.2, seed=2),
        layers.RandomZoom(0.2, seed=3), layers.RandomContrast(0.3, seed=4),
        layers.Resizing(6, 6), layers.Conv2D(4, 3, activation="relu"),
        layers.GlobalAveragePooling2D(), layers.Dense(3, activation="softmax")])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    model._jit_compile = True  # as keras_dp always compiles its step
    return model


CASES = {
    # Constraints: Keras applies them in the optimizer's apply, after the update.
    "constraints": (classifier(lambda: layers.Dense(
        8, activation="relu", kernel_constraint=keras.constraints.MaxNorm(0.3),
        bias_constraint=keras.constraints.NonNeg())), tabular),
    "spectral_normalization": (classifier(lambda: layers.SpectralNormalization(
        layers.Dense(8, activation="relu"), power_iterations=2)), tabular),
    "non_trainable_assigned_in_call": (classifier(AssignsInCall), tabular),
    "jax_ops_custom_gradient_stop_gradient": (classifier(JaxOps), tabular),
    "jax_layer_with_state_and_rng": (classifier(lambda: layers.JaxLayer(
        jax_call, init_fn=jax_init, seed=4)), tabular),
    "lora": (classifier(lambda: layers.Dense(8, activation="relu"), prepare=lambda m: (
        m.layers[0].enable_lora(2)), optimizer=lambda: keras.optimizers.Adam(0.01)), tabular),
    "int8": (classifier(lambda: layers.Dense(8, activation="relu"),
                        prepare=lambda m: m.quantize("int8")), tabular),
    "noise_and_dropouts": (classifier(
        lambda: layers.Dense(8, activation="selu"), lambda: layers.GaussianNoise(0.5, seed=1),
        lambda: layers.AlphaDropout(0.3, seed=2)), tabular),
    "normalizations": (classifier(
        lambda: layers.Dense(8), layers.LayerNormalization,
        lambda: layers.GroupNormalization(groups=4), layers.UnitNormalization,
        optimizer=lambda: keras.optimizers.SGD(0.05)), tabular),
    "augmentation": (classifier(
        lambda: layers.RandomFlip(seed=1), lambda: layers.RandomContrast(0.3, seed=2),
        lambda: layers.SpatialDropout2D(0.3, seed=3), lambda: layers.Resizing(6, 6),
        *conv_head(), shape=(8, 8, 3), optimizer=lambda: keras.optimizers.SGD(0.05)), images),
    "preprocessing_inside": (preprocessing_inside, images),
}


@pytest.mark.slow  # 7 to 37 s each on 2 shared cores: compilation, mostly
@pytest.mark.parametrize("case", sorted(CASES))
def test_layer_trains_as_in_keras_fit(case):
    build, data = CASES[case]
    assert_close_to_keras_fit(build, data())


@pytest.mark.slow  # 7 to 14 s on 2 shared cores
def test_random_layers_draw_new_numbers_each_step_and_none_at_predict():
    # What equality with Keras implies, asserted directly: the seed decides
    # the draws (two runs are bitwise equal), each step draws anew (the
    # seed generator advanced once per step), and inference draws nothing.
    build = classifier(lambda: layers.GaussianNoise(0.5, seed=1))
    x, y = tabular()
    runs = [build() for _ in range(2)]
    for model in runs:
        keras_dp.fit_sharded(model, x, y, devices=devices(3), **OPTIONS)
    for left, right in zip(runs[0].variables, runs[1].variables, strict=True):
        np.testing.assert_array_equal(left.value, right.value)
    noise = runs[0].layers[0]
    np.testing.assert_array_equal(noise.seed_generator.state.value, [1, 6])  # 6 steps
    trainer = keras_dp.ShardedTrainer(runs[0], devices=devices(3))
    first = trainer.predict(x, batch_size=10, verbose=0)
    np.testing.assert_array_equal(trainer.predict(x, batch_size=10, verbose=0), first)


@pytest.mark.slow  # 12 to 19 s on 2 shared cores
def test_a_flax_module_in_a_flax_layer_trains_as_in_keras_fit():
    nn = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, training=False):
            h = nn.relu(nn.Dense(8)(x))
            return nn.Dropout(0.3, deterministic=not training)(nn.LayerNorm()(h))

    assert_close_to_keras_fit(classifier(lambda: layers.FlaxLayer(Block())), tabular())


def change_trainables(model, change):
    if change == "enable_lora":
        model.get_layer("hidden").enable_lora(2)
    else:
        model.quantize("int8")


NAMED = {"enable_lora": r"Trainable now, without slots: .*hidden/lora_kernel_a, "
                        r".*hidden/lora_kernel_b\. No longer trainable, with slots: "
                        r".*hidden/kernel\.$",
         "quantize": r"No longer trainable, with slots: .*hidden/kernel, .*dense\w*/kernel\.$"}
LORA_OR_QUANTIZE = classifier(lambda: layers.Dense(8, activation="relu", name="hidden"),
                              optimizer=lambda: keras.optimizers.Adam(0.01))


@pytest.mark.parametrize("change", ["enable_lora", "quantize"])
def test_lora_or_quantize_after_training_asks_for_a_new_optimizer_naming_the_variables(change):
    # Keras's model.fit fails here inside its step ("Argument
    # `optimizer_variables` must be a list of tensors corresponding 1:1 ...");
    # keras_dp said only that a layer's `trainable` had changed.
    x, y = tabular()
    model = LORA_OR_QUANTIZE()
    keras_dp.fit_sharded(model, x, y, batch_size=25, verbose=0, devices=devices(3))
    change_trainables(model, change)
    trained = [np.asarray(v.value) for v in model.variables]
    with pytest.raises(ValueError, match=r"layer\.enable_lora\(rank\) or model\.quantize\(mode\) "
                       r"takes effect, as in Keras, only after model\.compile\(\.\.\.\) with a "
                       r"new optimizer.*" + NAMED[change]):
        keras_dp.fit_sharded(model, x, y, batch_size=25, verbose=0, devices=devices(3))
    for variable, before in zip(model.variables, trained, strict=True):
        np.testing.assert_array_equal(variable.value, before)


@pytest.mark.slow  # 13 to 24 s each on 2 shared cores
@pytest.mark.parametrize("change", ["enable_lora", "quantize"])
def test_lora_or_quantize_after_training_then_compile_equals_keras_fit(change):
    x, y = tabular()
    reference, model = LORA_OR_QUANTIZE(), LORA_OR_QUANTIZE()
    reference.fit(x, y, **OPTIONS)
    keras_dp.fit_sharded(model, x, y, devices=devices(3), **OPTIONS)
    change_trainables(reference, change)
    change_trainables(model, change)
    for ours, theirs in zip(model.variables, reference.variables, strict=True):
        if "lora" in ours.path:  # drawn from Keras's global seed, after the reference's
            ours.assign(np.asarray(theirs.value))
    for each in (reference, model):  # the fix the message names
        each.compile(optimizer=keras.optimizers.Adam(0.01), loss=each.loss, metrics=["accuracy"])
    expected = reference.fit(x, y, **OPTIONS).history
    got = keras_dp.fit_sharded(model, x, y, devices=devices(3), **OPTIONS).history
    np.testing.assert_allclose(got["loss"], expected["loss"], rtol=1e-5)
    for ours, theirs in zip(model.variables, reference.variables, strict=True):
        assert_scaled_close(ours.value, theirs.value, ours.path)


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float16", marks=pytest.mark.slow)])
def test_a_16_bit_layer_in_a_float32_model_is_bitwise_keras_on_one_device(dtype):
    # README: such layers train bitwise as Keras's on one device; on 3 the
    # all-reduce sums their gradients in another order in their own
    # precision, so they differ by its rounding.
    rng = np.random.default_rng(0)
    x, y = rng.random((50, 6), "float32"), rng.integers(0, 3, 50)
    results = []
    for count in (None, 1, 3):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((6,)),
                                  layers.Dense(8, activation="relu", dtype=dtype),
                                  layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        kwargs = dict(batch_size=16, epochs=2, shuffle=False, verbose=0)
        if count is None:
            model.fit(x, y, **kwargs)
        else:
            keras_dp.fit_sharded(model, x, y, devices=devices(count), **kwargs)
        results.append([np.asarray(v.value, "float64") for v in model.trainable_variables])
    keras_fit, one, three = results
    for theirs, mine in zip(keras_fit, one, strict=True):
        np.testing.assert_array_equal(mine, theirs)
    epsilon = float(jnp.finfo(dtype).eps)
    for theirs, mine in zip(keras_fit, three, strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=0, atol=epsilon * np.abs(theirs).max())
