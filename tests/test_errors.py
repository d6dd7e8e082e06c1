"""Bad input fails at once, with a message that names the problem and the fix."""

import re

import keras
import numpy as np
import pytest

import keras_dp
from conftest import BatchEnds, devices, mlp


def test_a_non_keras_object_is_refused():
    with pytest.raises(TypeError, match="keras_dp trains a keras.Model.*Received an object of type"):
        keras_dp.fit_sharded(object(), np.zeros((8, 28, 28, 1)), np.zeros(8))
    with pytest.raises(TypeError, match="Wrap layers in keras.Sequential"):
        keras_dp.ShardedTrainer(keras.layers.Dense(3))


def test_labels_that_do_not_fit_the_output_are_refused_before_compiling(mnist):
    (x, y), _ = mnist
    one_hot = np.eye(10, dtype=np.float32)[y[:64]]
    with pytest.raises(ValueError, match=r"labels do not fit.*y has shape \(64, 10\).*sparse_categorical"):
        keras_dp.fit_sharded(mlp(), x[:64], one_hot, batch_size=64, verbose=0, devices=devices(2))
    with pytest.raises(ValueError, match="labels do not fit") as error:
        keras_dp.fit_sharded(mlp(), x[:64], np.zeros((64, 3)), batch_size=64, verbose=0)
    # keras_dp's own message, without Keras's chained traceback or a repr.
    assert error.value.__cause__ is None and error.value.__suppress_context__
    assert "the loss is sparse_categorical_crossentropy. Give labels" in str(error.value)
    assert str(error.value).endswith(
        "Keras reported: Arguments `target` and `output` must have the same shape up "
        "until the last dimension: target.shape=(64, 3), output.shape=(64, 10)")


def test_a_loss_of_one_value_per_sample_is_refused_before_compiling():
    # Keras's model.fit fails inside its first step: "Gradient only defined for
    # scalar-output functions. Output had shape: (6,)".
    class SquaredError(keras.losses.Loss):
        def call(self, y_true, y_pred):
            return keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile("sgd", SquaredError(reduction=None, name="squared_error"))
    x, y = np.ones((6, 3), "float32"), np.ones((6, 2), "float32")
    with pytest.raises(ValueError, match=r"one number per batch, but its compute_loss returns "
                       r"shape \(6,\) \(loss: squared_error\).*reduction=None") as error:
        keras_dp.fit_sharded(model, x, y, batch_size=6, verbose=0, devices=devices(2))
    assert error.value.__cause__ is None and error.value.__context__ is None
    assert int(model.optimizer.iterations) == 0
    model.compile("sgd", SquaredError(reduction="sum"))  # the fix trains
    losses = keras_dp.fit_sharded(model, x, y, batch_size=6, verbose=0, devices=devices(2))
    assert len(losses.history["loss"]) == 1


def test_an_uncompiled_model_without_optimizer_and_loss_is_refused():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    trainer = keras_dp.ShardedTrainer(model)  # enough to predict
    x = np.ones((5, 4), "float32")
    with pytest.raises(ValueError, match="not compiled.*model.compile"):
        trainer.fit(x, np.ones((5, 2)), verbose=0)
    with pytest.raises(ValueError, match="not compiled.*model.compile"):
        keras_dp.fit_sharded(model, x, np.ones((5, 2)), verbose=0)


def test_an_unbuildable_model_is_refused_with_the_fix():
    model = keras.Sequential([keras.layers.Reshape((4, 5)), keras.layers.Dense(10)])
    keras_dp.models.compile_classifier(model)
    with pytest.raises(ValueError, match=(
            r"could not be built on the data's x \(shapes \(8, 18\)\): ValueError: "
            r"The total size of the tensor must be unchanged.*build the model yourself")):
        keras_dp.fit_sharded(model, np.ones((8, 18), "float32"), np.zeros(8), verbose=0,
                             devices=devices(2))


class FailsInCall(keras.layers.Layer):
    """Fails once `failing` is set: on data, not in the Sequential that builds it."""

    failing = False

    def call(self, x):
        if self.failing:
            raise KeyError("a bug of the user's")
        return x


@pytest.mark.parametrize("case", ["width", "validation", "one sample", "user code"])
def test_x_that_a_built_model_fails_on_is_named_without_a_build_fix(case):
    # Was "The model could not be built on the data's x ... or build the model
    # yourself with model.build(input_shape)" for a model built with
    # keras.Input, with Keras's internals chained under it (61 lines), and
    # "the data's" for the validation data's x.
    user_layer = FailsInCall()
    model = keras.Sequential([keras.Input((4,))] + [user_layer] * (case == "user code")
                             + [keras.layers.Dense(3)])
    user_layer.failing = True
    keras_dp.models.compile_classifier(model)
    x, y = np.ones((8, 4), "float32"), np.zeros(8)
    trainer = keras_dp.ShardedTrainer(model, devices=devices(2))
    with pytest.raises(ValueError) as raised:
        if case == "width":
            trainer.fit(x[:, :3], y, verbose=0)
        elif case == "validation":
            trainer.fit(x, y, validation_data=({"a": x}, y), verbose=0)
        elif case == "one sample":
            trainer.predict(x[0], verbose=0)
        else:
            trainer.fit(x, y, verbose=0)
    message = str(raised.value)
    assert "model.build" not in message and "could not be built" not in message
    assert message.startswith("The model, built for inputs of shape (None, 4), fails on ")
    expected = {
        "width": r"the data's x \(shapes \(8, 3\)\): ValueError: Input 0 .* expected axis "
                 r"-1 of input shape to have value 4, but received input with shape \(8, 3\) "
                 r"Give x the shapes and structure of the model's inputs",
        "validation": r"the validation data's x \(shapes \{'a': \(8, 4\)\}\): ValueError: "
                      r"The structure of `inputs` doesn't match",
        "one sample": r"x of shape \(4,\) has no batch dimension: for one sample pass "
                      r"x\[None\]",
        "user code": r"KeyError: a bug of the user's It was raised in your code "
                     r"\(FailsInCall.call, line \d+ of .*test_errors.py\); its traceback is "
                     r"chained above. Fix it there, or",
    }[case]
    assert re.search(expected, message), message
    assert "Exception encountered" not in message and "\x1b" not in message
    if case == "user code":  # the user's frame is kept, under Keras's own error
        assert isinstance(raised.value.__cause__, KeyError)
    else:
        assert raised.value.__cause__ is None and raised.value.__suppress_context__
    assert int(model.optimizer.iterations.numpy()) == 0


def test_init_state_of_an_unbuilt_model_names_the_fix():
    model = keras_dp.models.compile_classifier(keras.Sequential([keras.layers.Dense(10)]))
    with pytest.raises(ValueError, match=r"not built.*trainer.build\(batch\)"):
        keras_dp.ShardedTrainer(model).init_state()


def test_a_mesh_of_two_axes_is_refused():
    import jax
    mesh = jax.make_mesh((2, 1), ("batch", "model"), devices=jax.devices()[:2])
    with pytest.raises(ValueError, match="needs a 1-D mesh.*keras_dp.make_mesh"):
        keras_dp.ShardedTrainer(mlp(), mesh=mesh)


def test_bad_validation_labels_fail_before_the_first_step(mnist):
    (x, y), _ = mnist
    record = BatchEnds()
    with pytest.raises(ValueError, match="labels do not fit"):
        keras_dp.fit_sharded(mlp(), x[:128], y[:128], batch_size=64, verbose=0,
                             validation_data=(x[:64], np.zeros((64, 3))),
                             callbacks=[record], devices=devices(2))
    assert record.ends == []


def test_a_model_parallel_keras_distribution_with_devices_is_refused_not_ignored():
    layout = keras.distribution.LayoutMap(keras.distribution.DeviceMesh((2,), ["model"],
                                                                        devices(2)))
    layout["dense.*kernel"] = (None, "model")
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout, batch_dim_name=None))
    try:
        with pytest.raises(ValueError, match="ModelParallel distribution is active.*`devices` "
                                             r"was given.*set_distribution\(None\)"):
            keras_dp.ShardedTrainer(mlp(), devices=devices(2))
        with pytest.raises(ValueError, match="Ensembles train with data parallelism only.*"
                                             "ModelParallel"):
            keras_dp.fit_ensemble(mlp, np.zeros((8, 28, 28, 1)), np.zeros(8), verbose=0,
                                  devices=devices(2))
        keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices(2)))
        keras_dp.ShardedTrainer(mlp(), devices=devices(2))  # the same layout: accepted
    finally:
        keras.distribution.set_distribution(None)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_steps_in_flight_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="steps_in_flight.*at least 1.*Received: steps_in_flight="):
        keras_dp.ShardedTrainer(mlp(), steps_in_flight=bad)


def test_checkpoints_with_steps_per_epoch_are_refused_before_training(mnist, tmp_path):
    (x, y), _ = mnist
    model = mlp()
    with pytest.raises(ValueError, match="checkpoint_dir combines with steps_per_epoch only for a Grain source"):
        keras_dp.fit_sharded(model, x[:64], y[:64], steps_per_epoch=2, verbose=0,
                             checkpoint_dir=tmp_path / "ckpt", devices=devices(2))
    assert int(model.optimizer.iterations.value) == 0


def test_labels_missing_for_a_compiled_loss_are_named(mnist):
    (x, _), _ = mnist
    with pytest.raises(ValueError, match="compiled with a loss.*no labels"):
        keras_dp.fit_sharded(mlp(), x[:64], verbose=0, devices=devices(2))


def test_a_recompiled_optimizer_is_built_again_by_the_build_cache(mnist):
    (x, y), _ = mnist
    model = mlp()
    trainer = keras_dp.ShardedTrainer(model, devices=devices(2))
    trainer.build((x[:8], y[:8]))
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=model.loss)
    assert not model.optimizer.built
    trainer.build((x[:8], y[:8]))  # same data: the cache must see a new optimizer
    assert model.optimizer.built


def test_a_ragged_python_list_is_refused_at_once_with_the_padding_fix():
    rng = np.random.default_rng(0)
    x = [list(rng.integers(1, 100, rng.integers(3, 40))) for _ in range(2000)]
    model = keras.Sequential([keras.layers.Embedding(100, 8),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2)])
    model.compile("adam", "sparse_categorical_crossentropy")
    for data in (dict(x=x, y=np.zeros(2000)), dict(x=x, y=np.zeros(2000), validation_split=0.5)):
        with pytest.raises(ValueError, match=r"list of 2000 items of different lengths "
                                             r"\(3 to 39\).*keras.utils.pad_sequences") as raised:
            keras_dp.fit_sharded(model, **data, verbose=0, devices=devices(2))
        assert len(str(raised.value)) < 400


def test_a_long_listing_in_a_message_is_cut_short():
    arrays = [np.zeros((3,))] * 500 + [np.zeros((4,))]
    with pytest.raises(ValueError, match=r"same number of rows.*\.\.\. \(501 in all\)") as raised:
        keras_dp.sharding.batch_rows(arrays)
    assert len(str(raised.value)) < 400


def dense_batches(shapes):
    rng = np.random.default_rng(0)
    return [(rng.normal(size=(16, *shape)).astype("float32"), rng.integers(0, 10, 16))
            for shape in shapes]


@pytest.mark.parametrize("steps_per_execution", [1, 2])
def test_a_batch_whose_shape_changes_mid_stream_is_named(steps_per_execution):
    model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(10)])
    model.compile("sgd", "sparse_categorical_crossentropy")
    batches = dense_batches([(20,)] * 3 + [(18,)])
    with pytest.raises(ValueError, match=(
            r"Batch 3 of epoch 1 .*shapes \[\(18,\), \(\)\] after the row dimension, where the "
            r"first batch had \[\(20,\), \(\)\].*expected axis -1.*keras.Input")):
        keras_dp.fit_sharded(model, batches, verbose=0, devices=devices(2),
                             steps_per_execution=steps_per_execution)
    assert int(model.optimizer.iterations.numpy()) == 3  # the batches before it trained


def test_a_shape_change_names_the_layers_own_reason_not_kerass_wrapper():
    # Was "... cannot take them: ValueError: Exception encountered when calling
    # Reshape.call()." (the first line of Keras's wrapped error), without the reason.
    model = keras.Sequential([keras.Input((None,)), keras.layers.Reshape((4, 5)),
                              keras.layers.Flatten(), keras.layers.Dense(10)])
    model.compile("sgd", "sparse_categorical_crossentropy")
    with pytest.raises(ValueError) as raised:
        keras_dp.fit_sharded(model, dense_batches([(20,)] * 2 + [(18,)]), verbose=0,
                             devices=devices(2))
    assert "Exception encountered" not in str(raised.value)
    assert re.search(r"Batch 2 of epoch 1 .*cannot take them: ValueError: The total size of "
                     r"the tensor must be unchanged. Received: input_shape=\(18,\), "
                     r"target_shape=\(4, 5\) Give every batch", str(raised.value))


def test_batches_of_several_lengths_train_when_the_model_takes_them():
    # A sequence model with a None length: batches padded per batch, as
    # tf.data's padded_batch gives them, with K=2 (stacks of one shape only).
    model = keras.Sequential([keras.Input((None, 3)), keras.layers.GlobalAveragePooling1D(),
                              keras.layers.Dense(10)])
    model.compile("sgd", "sparse_categorical_crossentropy")
    batches = dense_batches([(5, 3), (5, 3), (7, 3), (7, 3), (7, 3), (5, 3)])
    history = keras_dp.fit_sharded(model, batches, verbose=0, devices=devices(2),
                                   steps_per_execution=2)
    assert int(model.optimizer.iterations.numpy()) == 6
    assert np.isfinite(history.history["loss"][0])


class ForgetsTheMetrics(keras.Model):
    """A stateless train_step that returns 3 of the 4 groups of its state."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x)

    def train_step(self, state, data):
        trainable, non_trainable, optimizer, _ = state
        return {"loss": keras.ops.sum(data[0])}, (trainable, non_trainable, optimizer)


def test_a_custom_train_step_returning_a_short_state_is_named():
    model = ForgetsTheMetrics()
    model.compile("sgd", "mse")
    with pytest.raises(TypeError, match=r"ForgetsTheMetrics.train_step returned a state of 3 "
                                        r"items.*\(trainable_variables, non_trainable_variables, "
                                        r"optimizer_variables, metrics_variables\)"):
        keras_dp.fit_sharded(model, np.ones((8, 3)), np.ones((8, 2)), verbose=0,
                             devices=devices(2))


@pytest.mark.parametrize("argument, value", [
    ("batch_size", 16.5), ("batch_size", 16.0), ("batch_size", "16"), ("epochs", 2.0),
    ("initial_epoch", 1.0), ("steps_per_epoch", 2.5), ("validation_batch_size", 8.5),
    ("epochs", True)])  # a bool was taken as 1
def test_a_count_that_is_not_an_integer_is_refused_not_rounded(argument, value):
    # Keras fails on these deep in its loop ("slice indices must be
    # integers"); keras_dp used to train batch_size=16.5 as 16, silently.
    x, y = np.zeros((32, 28, 28, 1), "float32"), np.zeros(32, "int32")
    with pytest.raises(TypeError) as error:
        keras_dp.fit_sharded(mlp(), x, y, verbose=0, devices=devices(2), validation_data=(x, y),
                             **{"batch_size": 8, argument: value})
    assert str(error.value) == (
        f"`{argument}` must be an integer. Received: {argument}={value!r} (of type "
        f"{type(value).__name__}). Pass an int; keras_dp does not round it.")
    assert error.value.__cause__ is None and error.value.__suppress_context__


@pytest.mark.parametrize("fit", ["fit_sharded", "fit_ensemble"])
def test_a_negative_initial_epoch_is_refused_before_any_step(fit):
    # Was "ValueError: expected non-negative integer" from inside the epoch
    # loop, noted "the model holds the weights after 0 steps of epoch 0".
    # Keras's fit runs range(-1, epochs), an epoch "-1" more than asked.
    x, y = np.zeros((8, 4), "float32"), np.zeros(8, "int32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile("sgd", "sparse_categorical_crossentropy")
    with pytest.raises(ValueError) as error:
        getattr(keras_dp, fit)(model, x, y, initial_epoch=-1, epochs=2, verbose=0, devices=devices(2))
    assert str(error.value) == "`initial_epoch` must be at least 0. Received: initial_epoch=-1."
    assert not getattr(error.value, "__notes__", None)


@pytest.mark.parametrize("given", [["y"], ["sample_weight"], ["y", "sample_weight"]])
def test_y_or_sample_weight_beside_a_dataset_is_named_as_given(given):
    # Said "Received x of type list_iterator and y." for a sample_weight alone.
    x, y = np.zeros((8, 4), "float32"), np.zeros(8, "int32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile("sgd", "sparse_categorical_crossentropy")
    arrays = {"y": y, "sample_weight": np.ones(8)}
    with pytest.raises(ValueError, match=(
            r"^`y` and `sample_weight` go with array inputs only; a dataset carries its own. "
            rf"Received x of type list_iterator and {' and '.join(given)}: put them in its "
            r"batches")):
        keras_dp.fit_sharded(model, iter([(x, y)]), verbose=0, devices=devices(2),
                             **{name: arrays[name] for name in given})


def test_integer_counts_of_numpy_types_are_accepted():
    x, y = np.zeros((32, 28, 28, 1), "float32"), np.zeros(32, "int32")
    history = keras_dp.fit_sharded(mlp(), x, y, batch_size=np.int64(8), epochs=np.int32(1),
                                   verbose=0, devices=devices(2))
    assert len(history.history["loss"]) == 1


def test_validation_data_without_labels_is_named_as_the_validation_data():
    x, y = np.zeros((32, 28, 28, 1), "float32"), np.zeros(32, "int32")
    for validation_data in [(x,), x]:
        with pytest.raises(ValueError) as error:
            keras_dp.fit_sharded(mlp(), x, y, batch_size=8, verbose=0, devices=devices(2),
                                 validation_data=validation_data)
        assert str(error.value) == (
            "The model is compiled with a loss (sparse_categorical_crossentropy), but the "
            "validation data has no labels: give it labels, validation_data=(x_val, y_val) "
            "or (x, y) batches. A model whose losses all come from add_loss is compiled "
            "without one: model.compile(optimizer=...).")


def test_a_list_of_numbers_or_a_single_value_as_data_is_refused_with_the_fix():
    # Keras fails on these with "tuple index out of range" or "Unrecognized
    # data type"; keras_dp said the data's arrays had shapes [(64, 8), (), (), ...].
    x, y = np.zeros((32, 28, 28, 1), "float32"), np.zeros(32, "int32")
    with pytest.raises(ValueError) as error:
        keras_dp.fit_sharded(mlp(), x, list(y), verbose=0, devices=devices(2))
    assert str(error.value) == (
        "y is a Python list of 32 numbers. A list is read as one array per model input or "
        "output, as in Keras; for one value per sample, pass an array: np.asarray(y).")
    with pytest.raises(ValueError, match=r"^sample_weight is a Python tuple of 32 numbers"):
        keras_dp.fit_sharded(mlp(), x, y, sample_weight=(1.0,) * 32, verbose=0)
    with pytest.raises(ValueError) as error:
        keras_dp.fit_sharded(mlp(), x, 3, verbose=0, devices=devices(2))
    assert str(error.value) == (
        "y is a single value (3), not an array with one row per sample. Pass an array of "
        "one row per sample for y.")
    # A table's rows as nested lists (`frame.values.tolist()`): Keras's fit says
    # "Unrecognized data type"; keras_dp said x had "arrays of different lengths"
    # x[0][0] None, x[0][1] None, ... (each number taken for an input of no rows).
    with pytest.raises(ValueError) as error:
        keras_dp.fit_sharded(mlp(), x[:, :2, 0, 0].tolist(), y, verbose=0, devices=devices(2))
    assert str(error.value) == (
        "x is a Python list of 32 lists of numbers. A list is read as one array per model "
        "input or output, as in Keras (whose fit refuses lists of numbers); for one row per "
        "sample, pass an array: np.asarray(x).")


def test_trainable_changed_after_training_without_a_new_optimizer_is_named():
    # Keras's model.fit fails here inside its step with "Argument
    # `optimizer_variables` must be a list of tensors corresponding 1:1 ...".
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 8)).astype("float32"), rng.integers(0, 3, 16)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, name="base"),
                              keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    keras_dp.fit_sharded(model, x, y, batch_size=8, verbose=0, devices=devices(2))
    trained = model.get_weights()
    model.get_layer("base").trainable = False
    for _ in range(2):  # uncompiled, then compiled with the built optimizer again
        with pytest.raises(ValueError) as error:
            keras_dp.fit_sharded(model, x, y, batch_size=8, verbose=0, devices=devices(2))
        assert str(error.value) == (
            "The model's trainable variables changed since its optimizer was built: 2 are "
            "trainable now, the optimizer holds slots for 4. A layer's `trainable` set after "
            "training (or during it, in a callback), layer.enable_lora(rank) or "
            "model.quantize(mode) takes effect, as in Keras, only after model.compile(...) "
            "with a new optimizer (for example keras.optimizers.Adam(1e-5)); compiling with "
            "the built model.optimizer again keeps its old slots. The weights are kept. No "
            f"longer trainable, with slots: {model.name}/base/kernel, {model.name}/base/bias.")
        for left, right in zip(model.get_weights(), trained, strict=True):
            np.testing.assert_array_equal(left, right)
        model.compile(optimizer=model.optimizer, loss=model.loss)
    model.compile(optimizer="sgd", loss=model.loss)
    keras_dp.fit_sharded(model, x, y, batch_size=8, verbose=0, devices=devices(2))
    np.testing.assert_array_equal(model.get_layer("base").get_weights()[0], trained[0])


@pytest.mark.parametrize("argument, value, error, message", [
    ("seed", "a", TypeError, "`seed` must be an integer. Received: seed='a' (of type str)."),
    ("seed", -1, ValueError, "`seed` must be at least 0. Received: seed=-1."),
    ("prefetch", -1, ValueError, "`prefetch` must be at least 0. Received: prefetch=-1."),
    ("prefetch", 1.5, TypeError, "`prefetch` must be an integer. Received: prefetch=1.5 (of type float)."),
    ("unroll", -1, ValueError, "`unroll` must be at least 0. Received: unroll=-1."),
])
def test_trainer_counts_are_checked_when_it_is_made(argument, value, error, message):
    # seed="a" failed at the first shuffle with numpy's "unrecognized seed
    # string"; prefetch=-1, prefetch=1.5 and unroll=-1 were taken silently.
    with pytest.raises(error) as raised:
        keras_dp.ShardedTrainer(mlp(), devices=devices(2), **{argument: value})
    assert str(raised.value).startswith(message)


@pytest.mark.parametrize("seed, error, message", [
    ("a", TypeError, "`seed` must be an integer. Received: seed='a' (of type str)."),
    (-1, ValueError, "`seed` must be at least 0. Received: seed=-1."),
    (1.5, TypeError, "`seed` must be an integer. Received: seed=1.5 (of type float)."),
])
def test_an_ensembles_seed_is_checked_before_any_member_is_built(seed, error, message):
    # Was: seed="a" failed in `seed + i` ("can only concatenate str"), -1 in
    # numpy's seeding ("Seed must be between 0 and 2**32 - 1"), 1.5 as a
    # ValueError of Keras's set_random_seed; ShardedTrainer checked its seed.
    built = []

    def build():
        built.append(True)
        return mlp()

    with pytest.raises(error) as raised:
        keras_dp.EnsembleTrainer(build, 2, seed=seed, devices=devices(2))
    assert str(raised.value).startswith(message) and not built


def test_a_list_of_strings_as_x_is_named_as_text_with_the_fix():
    # Was "x is a Python list of 20 numbers ... pass an array: np.asarray(x)",
    # and np.asarray(x) then failed as text. model.fit says "Unrecognized data type".
    with pytest.raises(ValueError) as error:
        keras_dp.fit_sharded(mlp(), ["a cat", "a dog"] * 10, np.zeros(20), verbose=0,
                             devices=devices(2))
    assert str(error.value).startswith(
        "x is a Python list of 20 strings; keras_dp compiles its steps with JAX, which has "
        "no strings. Turn the text into token ids in the input pipeline: adapt a "
        "keras.layers.TextVectorization (or StringLookup) on it")


def test_a_pandas_frame_with_text_or_nullable_columns_is_named_with_the_fix():
    # Was "an array of dtype object ...; ragged sequences become `object`
    # arrays: pad them" (model.fit: "Invalid dtype: str"). A category or
    # nullable y of whole numbers is read as numbers, and trains.
    pd = pytest.importorskip("pandas")
    frame = pd.DataFrame({"a": np.arange(4.0), "b": ["u", "v"] * 2,
                          "c": pd.array([1, None] * 2, dtype="Int64")})
    with pytest.raises(ValueError) as error:
        keras_dp.fit_sharded(mlp(), frame, np.zeros(4), verbose=0, devices=devices(2))
    text = str(error.value).replace("'b' (object)", "'b' (str)")  # pandas 2 names str "object"
    assert text == (
        "x is a pandas DataFrame with columns numpy reads as objects, not numbers: "
        "'b' (str), 'c' (Int64). keras_dp, like model.fit, trains on numeric arrays: "
        "encode text or category columns as numbers (pd.get_dummies, or .cat.codes), and "
        "make nullable columns floats, filling missing values first: .astype('float32').")


def test_a_dataset_of_dicts_without_labels_is_told_to_map_them_to_tuples():
    # A TFDS-style element {"image", "label"} is all x (model.fit reads it so
    # too, and fails on the structure); the message said only "pass y".
    batches = [{"image": np.zeros((4, 28, 28, 1)), "label": np.zeros(4)}]
    with pytest.raises(ValueError, match=re.escape(
            "has no labels: pass y (or (x, y) batches); a batch that is a dict (keys "
            "['image', 'label']) is all x, as in model.fit: map it to a tuple, "
            "dataset.map(lambda d: (d['image'], d['label']))")):
        keras_dp.fit_sharded(mlp(), batches, verbose=0, devices=devices(2))


class _Preprocessing(keras.Model):
    """A keras_hub task's contract, without keras_hub: its own fit maps
    `preprocess_samples` (here, rescaling) over the data when it has a
    `preprocessor`."""

    def __init__(self, preprocessor):
        super().__init__()
        self.preprocessor = preprocessor
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x)

    def preprocess_samples(self, x, y=None, sample_weight=None):
        x = x if self.preprocessor is None else self.preprocessor(x)
        return keras.utils.pack_x_y_sample_weight(x, y, sample_weight)


def test_a_model_that_preprocesses_its_data_in_its_own_fit_is_refused_with_the_fix():
    # keras_hub's tasks preprocess in their own fit, evaluate and predict,
    # which keras_dp does not call: it would train on the raw data, silently.
    def build():
        model = _Preprocessing(keras.layers.Rescaling(1 / 255))
        model.compile(optimizer="sgd", loss="mse")
        return model

    model = build()
    x, y = np.ones((8, 3), "float32"), np.zeros((8, 2), "float32")
    for run in (lambda: keras_dp.fit_sharded(model, x, y, batch_size=4, devices=devices(2)),
                lambda: keras_dp.ShardedTrainer(model, devices=devices(2)).predict(x),
                lambda: keras_dp.fit_ensemble(build, x, y, members=2, batch_size=4)):
        with pytest.raises(ValueError, match=r"has a preprocessor \(Rescaling\), which its own "
                           r"fit.*model\.preprocessor = None") as raised:
            run()
        assert raised.value.__cause__ is None
    model.preprocessor = None  # the fix: preprocess the data, detach the preprocessor
    history = keras_dp.fit_sharded(model, x / 255, y, batch_size=4, epochs=1, verbose=0,
                                   devices=devices(2))
    assert len(history.history["loss"]) == 1


def test_unroll_true_or_false_means_what_it_means_in_lax_scan():
    # unroll=True was taken as 1: no unrolling, the opposite of jax.lax.scan's True.
    trainer = lambda unroll: keras_dp.ShardedTrainer(  # noqa: E731
        mlp(), devices=devices(2), steps_per_execution=4, unroll=unroll)
    assert (trainer(True).unroll, trainer(False).unroll, trainer(2).unroll) == (4, 1, 2)
