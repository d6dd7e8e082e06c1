"""The sharded step: replicas in sync, global BatchNorm, per-shard dropout."""

import jax
import keras
import numpy as np
import pytest

import keras_dp
from conftest import NO_GRADIENT, assert_close_to_scale, batches_of, convnet, devices


def train_by_hand(model, batches, n_devices):
    """Run the trainer's parts step by step; return losses, final state, trainer."""
    trainer = keras_dp.ShardedTrainer(model, devices=devices(n_devices))
    trainer.build(batches[0])
    state = trainer.init_state()
    losses = []
    for batch in batches:
        state, logs = trainer.train_step(state, trainer.shard(batch))
        losses.append(float(logs["loss"]))
    return losses, state, trainer


@pytest.mark.slow  # test_exact checks an epoch in float32 and float64
def test_four_devices_track_one_device_for_20_steps_in_float32(mnist):
    # The guide's setting (float32, Adam): per-step losses agree to 1e-5.
    # Weights are compared exactly in float64 (test_equivalence.py): in
    # float32 the all-reduce sums in another order, and one ReLU input
    # within 1e-6 of zero that flips sign changes later steps.
    batches = batches_of(mnist, 20)
    losses_1, state_1, _ = train_by_hand(convnet(seed=1), batches, 1)
    losses_4, state_4, _ = train_by_hand(convnet(seed=1), batches, 4)
    np.testing.assert_allclose(losses_4, losses_1, rtol=1e-5)
    assert losses_1[-1] < losses_1[0]  # it really trained


@pytest.mark.slow  # 8 s; test_exact checks the convnet, BatchNorm included, against Keras in CI
def test_batchnorm_statistics_are_over_the_global_batch(mnist):
    batches = batches_of(mnist, 1)
    _, state_1, _ = train_by_hand(convnet(seed=2), batches, 1)
    _, state_4, _ = train_by_hand(convnet(seed=2), batches, 4)
    _, state_shard, _ = train_by_hand(convnet(seed=2), [tuple(a[:16] for a in batches[0])], 1)
    model = convnet(seed=2)
    names = [v.path for v in model.non_trainable_variables]
    moving = [i for i, name in enumerate(names) if "moving_mean" in name]
    assert len(moving) == 3
    for i in moving:
        assert_close_to_scale(state_4.non_trainable[i], state_1.non_trainable[i])
        # Statistics of one device's 16 rows alone would differ.
        assert not np.allclose(
            np.asarray(state_shard.non_trainable[i]), np.asarray(state_1.non_trainable[i]),
            rtol=1e-3, atol=1e-6,
        )


def test_dropout_masks_differ_between_shards_and_match_one_device():
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dropout(0.5)])
    x = np.ones((8, 64), np.float32)  # identical rows: any difference is the mask

    def masks(n_devices):
        mesh = keras_dp.make_mesh(devices(n_devices))
        x_device = jax.device_put(x, keras_dp.sharding.Layout(mesh).batch)
        seed_state = [np.asarray(v.value) for v in model.non_trainable_variables]
        call = jax.jit(lambda s, x: model.stateless_call([], s, x, training=True)[0])
        return np.asarray(call(seed_state, x_device))

    out_4, out_1 = masks(4), masks(1)
    np.testing.assert_array_equal(out_4, out_1)
    shard_rows = out_4.reshape(4, 2, 64)
    assert len({row.tobytes() for row in shard_rows[:, 0]}) == 4
    assert 0.3 < (out_4 == 0).mean() < 0.7


def test_the_model_is_traced_once_per_kind_of_data(mnist, monkeypatch):
    # Re-tracing the model on every fit call cost small models several steps.
    from keras_dp.keras import build as build_lib

    calls = []
    real_build = build_lib.build
    monkeypatch.setattr(build_lib, "build", lambda *a: calls.append(1) or real_build(*a))
    (x, y), _ = mnist
    trainer = keras_dp.ShardedTrainer(convnet(), devices=devices(2))
    for _ in range(3):
        trainer.fit(x[:64], y[:64], batch_size=32, verbose=0)
    assert len(calls) == 1
    # Labels of another shape are data of another kind: checked, and refused.
    for _ in range(2):
        with pytest.raises(ValueError, match="labels"):
            trainer.fit(x[:64], np.zeros((64, 3)), batch_size=32, verbose=0)
    assert len(calls) == 3


def test_state_is_replicated_and_batch_is_sharded(mnist):
    batch = batches_of(mnist, 1)[0]
    trainer = keras_dp.ShardedTrainer(convnet(), devices=devices(4))
    trainer.build(batch)
    state = trainer.init_state()
    for leaf in jax.tree.leaves(state):
        assert leaf.sharding.is_fully_replicated
        assert len(leaf.sharding.device_set) == 4
    sharded = trainer.shard(batch)
    x, y, _ = sharded.data
    assert sharded.rows == 64
    assert [s.data.shape[0] for s in x.addressable_shards] == [16] * 4
    text = trainer.describe(batch)
    assert "4 device(s) along axis 'batch'" in text
    assert "Batch: 64 rows, split along 'batch':" in text
    assert "cpu:1: rows 16-31" in text
    text = trainer.describe((batch[0][:30], batch[1][:30]))
    assert "30 rows, split along 'batch' (padded to 32; the step cuts rows 30-31 off)" in text
    assert "cpu:3: rows 24-29 + 2 padding" in text
    assert "trainable" in text and "PartitionSpec()" in text


@pytest.mark.slow  # test_exact.py checks uneven partial batches on 8 devices in CI
@pytest.mark.parametrize("n_devices", [1, 2, 8])
def test_partial_last_batch_runs_exactly(mnist, n_devices):
    # 100 rows at batch 64: the last batch has 36 rows, which 8 devices do
    # not divide; it is padded to 40, cut back to 36 inside the step, and
    # matches one device. (SGD: Adam
    # would turn float32 rounding in near-zero gradients into +-lr steps.)
    (x, y), _ = mnist
    results = []
    for n in (1, n_devices):
        model = convnet(seed=3)
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss=model.loss)
        keras_dp.fit_sharded(model, x[:100], y[:100], batch_size=64, shuffle=False,
                             verbose=0, devices=devices(n))
        results.append([(v.path, np.asarray(v.value)) for v in model.variables])
    for (path, a), (_, b) in zip(*results):
        if path != NO_GRADIENT:
            assert_close_to_scale(b, a, err_msg=path)


def _two_in_two_out():
    keras.utils.set_random_seed(0)
    a, b = keras.Input((64,), name="a"), keras.Input((5,), name="b")
    hidden = keras.layers.Dense(128, activation="relu")(keras.layers.Concatenate()([a, b]))
    model = keras.Model({"a": a, "b": b}, {"cls": keras.layers.Dense(3, name="cls")(hidden),
                                           "reg": keras.layers.Dense(1, name="reg")(hidden)})
    model.compile(optimizer="adam", loss={"cls": keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), "reg": "mse"}, metrics={"cls": ["accuracy"]})
    return model


def test_describe_shows_each_devices_real_rows_and_its_padding_in_mesh_order():
    rows = 10
    batch = ({"a": np.zeros((rows, 64), "float32"), "b": np.zeros((rows, 5), "float32")},
             {"cls": np.zeros(rows, "int32"), "reg": np.zeros((rows, 1), "float32")})
    trainer = keras_dp.ShardedTrainer(_two_in_two_out(), devices=devices(3))
    trainer.build(batch)
    text = trainer.describe(batch)
    # 10 rows on 3 devices: padded to 12, 4 + 4 + 2 real rows after the cut.
    for name in ("x['a']", "x['b']", "y['cls']", "y['reg']"):
        assert f"  {name}" in text
    assert text.count("cpu:0: rows 0-3 | cpu:1: rows 4-7 | cpu:2: rows 8-9 + 2 padding") == 4
    # Devices in a non-default order: listed in mesh order, as the rows go.
    order = [devices(4)[i] for i in (3, 1, 0, 2)]
    single = keras_dp.ShardedTrainer(_two_in_two_out(), devices=order).describe(
        jax.tree.map(lambda a: a[:2], batch))
    assert "cpu:3, cpu:1, cpu:0, cpu:2" in single
    assert "cpu:3: row 0 | cpu:1: row 1 | cpu:0: no rows + 1 padding | " \
           "cpu:2: no rows + 1 padding" in single


def test_describe_prints_each_groups_bytes_on_one_device_as_the_shards_hold_them():
    from keras_dp.diagnostics import memory

    batch = ({"a": np.zeros((8, 64), "float32"), "b": np.zeros((8, 5), "float32")},
             {"cls": np.zeros(8, "int32"), "reg": np.zeros((8, 1), "float32")})
    for mode, optimizer_bytes in (("replicated", 75_816), ("optimizer", 28_712)):
        trainer = keras_dp.ShardedTrainer(_two_in_two_out(), devices=devices(3),
                                          state_sharding=mode)
        trainer.build(batch)
        state = dict(trainer.init_state().groups())
        on_first = {name: sum(shard.data.nbytes for array in arrays
                              for shard in array.addressable_shards
                              if shard.device == devices(1)[0])
                    for name, arrays in state.items()}
        # 69 * 128 + 128 + 128 * 3 + 3 + 128 + 1 float32 values; Adam's two
        # slots of each, plus its iteration count and learning rate.
        assert on_first["trainable"] == 9_476 * 4
        assert on_first["optimizer"] == optimizer_bytes
        assert on_first["metrics"] == 32
        text = trainer.describe()
        shown = "74.0 KiB" if mode == "replicated" else "28.0 KiB"  # 75,816 / 28,712 B
        assert f"optimizer       14 arrays       18,954 values {shown:>10} per device" in text
        assert "trainable        6 arrays        9,476 values   37.0 KiB per device" in text
        assert "metrics          8 arrays            8 values       32 B per device" in text
        assert memory.format_bytes(on_first["optimizer"]) in text
    assert [memory.format_bytes(n) for n in (0, 1023, 1024, 3 * 2**20 // 2, 2**31)] == [
        "0 B", "1023 B", "1.0 KiB", "1.5 MiB", "2.00 GiB"]


def test_describe_shows_the_state_without_copying_it_to_the_devices():
    from keras_dp.diagnostics import memory

    # It read the state's layout from a placed copy (`init_state`): a whole
    # extra state per device for a moment, and across processes a broadcast.
    batch = (np.zeros((6, 28, 28, 1), "float32"), np.zeros(6, "int32"))
    trainer = keras_dp.ShardedTrainer(convnet(), devices=devices(2))
    trainer.build(batch)
    with jax.transfer_guard("disallow_explicit"):  # a copy to any device raises
        text = trainer.describe()
    state = trainer.init_state()
    for name, arrays in state.groups():  # the numbers of the placed state
        values, nbytes = sum(a.size for a in arrays), sum(a.nbytes for a in arrays)
        assert (f"{name:<14}{len(arrays):>4} arrays {values:>12,} values "
                f"{memory.format_bytes(nbytes):>10} per device") in text


def test_describe_says_where_the_fits_data_lives_and_how_k_batches_stack():
    import tensorflow as tf

    x, y = np.zeros((1000, 8), "float32"), np.zeros(1000, "int32")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    model.compile(optimizer="sgd", loss="mse")
    trainer = keras_dp.ShardedTrainer(model, devices=devices(3), steps_per_execution=4)
    text = trainer.describe((x[:10], y[:10]), x, y)
    assert ("A call of 4 steps takes 4 such batches stacked, [4, 12, ...], "
            "PartitionSpec(None, 'batch'): each device holds its rows of all 4.") in text
    # 1,000 x 8 float32 + 1,000 int32 = 36,000 bytes, one copy per device.
    assert text.endswith("Training data: 1,000 rows, 35.2 KiB, kept on the devices for the "
                         "fit: a full copy on each of the 3 (PartitionSpec()), each step "
                         "gathering its rows there.")
    one = keras_dp.ShardedTrainer(model, devices=devices(1))  # not "each of the 1"
    assert one.describe(x=x, y=y).endswith(
        "kept on the devices for the fit: a full copy on the device (PartitionSpec()), "
        "each step gathering its rows there.")
    host = keras_dp.ShardedTrainer(model, devices=devices(3), data_on_device=False)
    assert host.describe(x=x, y=y).endswith(
        "fed from the host, each batch copied to the devices when its step comes "
        "(data_on_device=False).")
    assert "A call of" not in host.describe((x[:10], y[:10]))
    stream = tf.data.Dataset.from_tensor_slices((x, y)).batch(10)
    assert keras_dp.ShardedTrainer(model, devices=devices(3)).describe(x=stream).endswith(
        "Training data: batches read as they come, fed from the host, each batch copied to "
        "the devices when its step comes (the data is a dataset or iterable, read batch by "
        "batch; pass numpy arrays (x, y) instead).")


def test_describe_numbers_real_rows_across_process_blocks_as_the_step_joins_them():
    from keras_dp.diagnostics import describe
    from keras_dp.sharding import DeviceBatch

    # Two processes' blocks of 4 padded rows holding 3 and 1 real rows: the
    # step joins rows 0-2 of block 0 and row 4 (its 4th real row, row 3).
    batch = DeviceBatch(None, rows=4, blocks=(3, 1))
    spans = [describe._real_span(start, start + 2, batch, 8) for start in (0, 2, 4, 6)]
    assert spans == [(0, 2), (2, 3), (3, 4), None]
    assert describe._real_span(0, 8, DeviceBatch(None, rows=5), 8) == (0, 5)


def _regression_model():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.BatchNormalization(), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    return model


def _regression_data(rows=50):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(rows, 6)).astype("float32"),
            rng.normal(size=(rows, 1)).astype("float32"))


@pytest.mark.parametrize("state_sharding", [
    "replicated", pytest.param("full", marks=pytest.mark.slow)])  # ~7 s each
def test_a_hand_written_epoch_loop_matches_model_fit(state_sharding):
    # The README's loop: 50 rows in batches of 16 on 3 devices (the last
    # batch of 2 rows does not divide), 2 epochs, metrics reset at each
    # epoch's start by `reset_metrics`; before it existed the logs of epoch
    # 2 were running means over both epochs (loss 1.0052 where Keras says 0.9782).
    x, y = _regression_data()
    reference = _regression_model()
    history = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    model = _regression_model()
    trainer = keras_dp.ShardedTrainer(model, devices=devices(3), state_sharding=state_sharding)
    batches = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 50, 16)]
    trainer.build(batches[0])
    state = trainer.init_state()
    for epoch in range(2):
        state = trainer.reset_metrics(state)
        for batch in batches:
            state, logs = trainer.train_step(state, trainer.shard(batch))
        for name in ("loss", "mae"):
            np.testing.assert_allclose(float(logs[name]), history.history[name][epoch],
                                       rtol=1e-5)
    layouts = jax.tree.leaves(trainer.state_layout())
    for leaf, sharding in zip(jax.tree.leaves(state), layouts, strict=True):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
    trainer.write_back(state)
    for ours, theirs in zip(model.get_weights(), reference.get_weights(), strict=True):
        assert_close_to_scale(ours, theirs)
    np.testing.assert_allclose(model.evaluate(x, y, verbose=0),
                               reference.evaluate(x, y, verbose=0), rtol=1e-5)


def test_train_step_refuses_a_donated_state_instead_of_crashing():
    # Reusing the donated state made JAX's compiled dispatch pass a deleted
    # buffer to XLA: the process died with a segfault.
    x, y = _regression_data(16)
    trainer = keras_dp.ShardedTrainer(_regression_model(), devices=devices(3))
    trainer.build((x, y))
    old = trainer.init_state()
    state, _ = trainer.train_step(old, trainer.shard((x, y)))
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(old))
    with pytest.raises(ValueError, match=r"donated to an earlier train_step.*state, logs = "):
        trainer.train_step(old, trainer.shard((x, y)))
    with pytest.raises(ValueError, match="donated"):
        trainer.write_back(old)
    state, logs = trainer.train_step(state, trainer.shard((x, y)))  # the new one still runs
    assert np.isfinite(float(logs["loss"]))


def test_train_step_names_the_fix_for_a_missing_state_or_an_unplaced_batch():
    x, y = _regression_data(16)
    trainer = keras_dp.ShardedTrainer(_regression_model(), devices=devices(3))
    trainer.build((x, y))
    with pytest.raises(TypeError, match=r"Received: state of type NoneType.*init_state\(\)"):
        trainer.train_step(None, trainer.shard((x, y)))
    state = trainer.init_state()
    with pytest.raises(TypeError, match=r"Received: state of type tuple"):
        trainer.train_step(tuple(state), trainer.shard((x, y)))
    with pytest.raises(TypeError, match=r"batch of type tuple.*trainer\.shard\(batch\)"):
        trainer.train_step(state, (x, y))
    # No labels for a loss that needs them: build's message, not 57 lines of
    # JAX ending in "None is not a valid value for jnp.array".
    with pytest.raises(ValueError, match=r"compiled with a loss \(mse\).*has no labels"):
        trainer.train_step(state, trainer.shard(x))
    assert all(not leaf.is_deleted() for leaf in jax.tree.leaves(state))


def test_init_state_of_a_built_model_without_its_optimizer_names_trainer_build():
    # Before, the message said "The model is not built" of a model with an
    # Input (built) and suggested model.build(input_shape), which builds
    # neither the optimizer nor the metrics that the state holds.
    x, y = _regression_data(16)
    model = _regression_model()
    assert model.built and not model.optimizer.built
    trainer = keras_dp.ShardedTrainer(model, devices=devices(3))
    with pytest.raises(ValueError, match=r"its optimizer, loss or metrics are not built\. "
                                         r"Call trainer\.build\(batch\)"):
        trainer.init_state()
    with pytest.raises(TypeError, match=r"compiled_train_step takes a batch placed"):
        trainer.compiled_train_step(None, (x, y))
    trainer.build((x, y))
    state = trainer.init_state()
    assert [leaf.shape for leaf in state.trainable] == [(6, 8), (8,), (8,), (8,), (8, 1), (1,)]


@pytest.mark.slow  # about 7 s: two fits
def test_after_fit_with_validation_the_model_metrics_hold_its_results_as_keras_does():
    # Keras validates with the model's own metrics, which then hold the
    # validation's results; the model held the last epoch's training results.
    x, y = _regression_data(40)
    options = dict(batch_size=16, epochs=1, shuffle=False, verbose=0,
                   validation_data=(x[:20], y[:20]))
    reference = _regression_model()
    history = reference.fit(x, y, **options).history
    model = _regression_model()
    keras_dp.fit_sharded(model, x, y, devices=devices(3), **options)
    ours, theirs = model.get_metrics_result(), reference.get_metrics_result()
    assert float(theirs["loss"]) == pytest.approx(history["val_loss"][0], rel=1e-6)
    assert sorted(ours) == sorted(theirs) == ["loss", "mae"]
    for name, value in theirs.items():
        assert float(ours[name]) == pytest.approx(float(value), rel=1e-5), name


def test_state_layout_of_a_model_not_built_is_refused_and_complete_once_built():
    # state_layout() on a model not built yet returned partial lists (no
    # weights, the optimizer's two counters, the metrics'), without a word.
    model = keras.Sequential([keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse",
                  metrics=["mae"])
    trainer = keras_dp.ShardedTrainer(model, devices=devices(2), state_sharding="full")
    fix = r"Call trainer.build\(batch\) with one batch of data first"
    with pytest.raises(ValueError, match="The state layout cannot be read yet: the model is "
                                         r"not built\. " + fix):
        trainer.state_layout()
    model.build((None, 6))  # the layers, not the optimizer
    with pytest.raises(ValueError, match="The state layout cannot be read yet: its optimizer, "
                                         "loss or metrics are not built"):
        trainer.state_layout()
    with pytest.raises(ValueError, match="The training state cannot be read yet: its optimizer"):
        trainer.init_state()
    trainer.build(_regression_data(4))
    layout = trainer.state_layout()
    state = trainer.init_state()
    assert [len(group) for group in layout] == [len(group) for group in state] == [4, 0, 6, 4]
    for leaf, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(layout), strict=True):
        assert leaf.sharding == sharding
