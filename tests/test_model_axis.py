"""A model axis: training under a Keras `ModelParallel` distribution on a 2x2 ("batch", "model") mesh.

The float64 comparisons with Keras's `fit` run in a script
(tests/scripts/model_axis.py: float64 and 4 devices set before JAX starts);
the rest trains small float32 models in this process on 4 of its 8
simulated devices.
"""

import contextlib
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import warnings

import jax
import keras
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import keras_dp
from conftest import assert_close_to_scale
from conftest import devices
from keras_dp import sharding

SCRIPT = pathlib.Path(__file__).parent / "scripts" / "model_axis.py"
ROWS, BATCH = 26, 5  # batches of 5 rows split 3 + 2 over the batch axis; the last of 1


def run_script(*arguments, timeout=280):
    """The JSON lines of tests/scripts/model_axis.py, by case."""
    result = subprocess.run([sys.executable, str(SCRIPT), *arguments], capture_output=True,
                            text=True, timeout=timeout, env=dict(os.environ))
    assert result.returncode == 0, result.stderr[-3000:]
    runs = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    return {run["case"]: run for run in runs}


def assert_exact_runs(runs, lora):
    """The float64 targets: 1e-9 of each variable's scale against one device, Keras's peer equal."""
    for case in ("argument", "global"):
        run = runs[case]
        assert run["dtype"] == "float64" and run["result_type"] == "float64"
        assert run["iterations"] == 6  # 2 epochs of 3 batches: every row once, none padded in
        np.testing.assert_allclose(run["loss"], run["reference_loss"], rtol=1e-12)
        for group in ("weights", "optimizer"):
            worst = max(run[group], key=run[group].get)
            assert run[group][worst] <= 1e-9, (case, group, worst, run[group][worst])
        # Every variable keeps the layout Keras created it with.
        assert run["layouts"] == run["built_layouts"]
        if lora:  # the optimizer holds the LoRA weights' slots only
            assert all("lora_kernel" in path for path in run["trainable"])
            assert all("lora_kernel" in path or path.endswith(("iteration", "learning_rate"))
                       for path in run["slots"])
    peer = runs["keras_peer"]
    # Where Keras's own fit runs (batch 4), keras_dp computes the same steps.
    assert max(peer["ours_vs_keras_parallel"].values()) <= 1e-12
    assert max(peer["ours_vs_one_device"].values()) <= 1e-9
    assert peer["layouts"] == peer["keras_parallel_layouts"]
    # Where it refuses (batch 5 on a batch axis of 2), keras_dp trained above.
    assert peer["keras_batch_5_error"].startswith("IndivisibleError")


def test_a_model_split_over_a_model_axis_equals_keras_fit_on_one_device_in_float64():
    # A 3-layer MLP, one kernel split over both axes (as Gemma's map does),
    # two over "model"; the distribution as an argument and set globally.
    runs = run_script("--model", "dense")
    assert_exact_runs(runs, lora=False)
    assert runs["argument"]["layouts"]["up/kernel"] == ["batch", "model"]
    assert runs["argument"]["layouts"]["mid/kernel"] == ["model", None]


@pytest.mark.slow  # 25 s each on the 2-core VM; the default suite runs "replicated"
@pytest.mark.parametrize("mode", ["optimizer", "full"])
def test_state_sharding_on_top_of_a_layout_map_computes_the_same_steps_in_float64(mode):
    # up/kernel (8, 512): ("batch", "model") by the map; mid/kernel (512, 16):
    # ("model", None), so the batch axis goes on its free dimension.
    runs = run_script("--model", "dense", "--cases", "argument", "--state-sharding", mode,
                      "--width", "512")
    run = runs["argument"]
    assert run["state_sharding"] == mode and run["iterations"] == 6
    for group in ("weights", "optimizer"):
        assert max(run[group].values()) <= 1e-9, (group, run[group])
    split = run["state_layouts"]
    assert split["up/kernel"] == ["batch", "model"]  # it uses the batch axis already
    assert split["mid/kernel"] == (["model", "batch"] if mode == "full" else ["model", None])
    slot = next(path for path in split if path.endswith("mid_kernel_momentum"))
    assert split[slot] == ["model", "batch"]
    # The map's layouts stay on the model's variables; the split over the
    # batch axis lives in the training state only.
    assert run["layouts"] == run["built_layouts"]


@pytest.mark.slow  # 60-80 s each on the 2-core VM: two Gemma compiles per case, float64
@pytest.mark.timeout(900)
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_gemma_on_a_2x2_mesh_with_keras_hubs_layout_map_equals_keras_fit_in_float64(lora):
    pytest.importorskip("keras_hub", reason=KERAS_HUB_MISSING)
    runs = run_script("--model", "gemma", *(["--lora"] if lora else []), timeout=880)
    assert_exact_runs(runs, lora)
    for run in (runs["argument"], runs["global"], runs["keras_peer"]):
        for block in (0, 1):  # the attention kernels stay split over "model"
            for name in ("query", "key", "value"):
                assert run["layouts"][f"decoder_block_{block}/attention/{name}/kernel"] == [
                    "model", "batch", None]
            assert run["layouts"][f"decoder_block_{block}/attention/attention_output/kernel"] == [
                "model", None, "batch"]
        assert run["layouts"]["token_embedding/embeddings"] == ["model", "batch"]


KERAS_HUB_MISSING = ("keras_hub is not installed: it is not in the [test] extra (it would bring "
                     "full TensorFlow beside tensorflow-cpu); pip install --no-deps "
                     "keras-hub==0.32.0 regex tokenizers (docs/testing.md)")


# -- In this process, float32 --------------------------------------------------


def distribution(keys=None, batch_dim_name="batch", shape=(2, 2)):
    mesh = keras.distribution.DeviceMesh(shape, ["batch", "model"], devices(4))
    layout_map = keras.distribution.LayoutMap(mesh)
    for key, axes in (keys or {".*up/kernel": ("batch", "model"),
                               ".*down/kernel": ("model", None)}).items():
        layout_map[key] = axes
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name=batch_dim_name)


def mlp(scope=None, width=32, seed=0):
    keras.utils.set_random_seed(seed)
    with scope.scope() if scope else contextlib.nullcontext():
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(width, activation="relu", name="up")(inputs)
        hidden = keras.layers.Dropout(0.25)(hidden)
        model = keras.Model(inputs, keras.layers.Dense(4, name="down")(hidden))
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    return model


def data(rows=ROWS):
    rng = np.random.default_rng(0)
    return rng.normal(size=(rows, 8)).astype("float32"), rng.normal(size=(rows, 4)).astype(
        "float32")


def weights(model):
    return [np.asarray(value) for value in model.get_weights()]


def test_state_sharding_splits_what_the_layout_map_leaves_whole_over_the_batch_axis():
    mesh = jax.make_mesh((2, 2), ("batch", "model"), devices=devices(4),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)

    class Bases:  # a variable's layout-map entry, by position
        def specs(self, group, count):
            return [P("model", None), P("model", "batch"), None, P(None, "model")][:count]

    shapes = [(64, 128), (64, 128), (64, 128), (8, 16)]
    for mode, split in (("replicated", False), ("optimizer", True), ("full", True)):
        layout = sharding.Layout(mesh, mode, "batch", Bases())
        values = [jax.ShapeDtypeStruct(shape, "float32") for shape in shapes]
        weights_ = [tuple(s.spec) for s in layout.group_shardings(values, "trainable")]
        slots = [tuple(s.spec) for s in layout.group_shardings(values, "optimizer")]
        assert slots == ([("model", "batch"), ("model", "batch"), (None, "batch"),
                          (None, "model")] if split else
                         [("model", None), ("model", "batch"), (), (None, "model")])
        # The map's batch split stays, and a small variable keeps its base.
        assert weights_ == (slots if mode == "full" else
                            [("model", None), ("model", "batch"), (), (None, "model")])
        grads = layout.gradient_shardings(values)
        assert [tuple(s.spec) for s in grads] == (slots if split else weights_)


def test_fit_under_a_distribution_keeps_the_layouts_and_steps_and_every_part_works(tmp_path):
    dist = distribution()
    x, y = data()
    reference = mlp(dist)
    keras_dp.fit_sharded(reference, x, y, batch_size=BATCH, epochs=2, verbose=0,
                         distribution=dist, data_on_device=False)
    kernel = reference.get_layer("up").kernel.value.sharding
    assert kernel.spec == P("batch", "model") and kernel.mesh.shape == {"batch": 2, "model": 2}
    assert reference.get_layer("down").kernel.value.sharding.spec == P("model", None)
    # Data on the devices, two steps per call, a callback that reads the
    # weights mid-fit: the same training.
    seen = []
    probe = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: seen.append(float(logs["loss"])))
    other = mlp(dist)
    history = keras_dp.fit_sharded(other, x, y, batch_size=BATCH, epochs=2, verbose=0,
                                   distribution=dist, data_on_device=True,
                                   steps_per_execution=2, callbacks=[probe])
    assert seen == history.history["loss"]
    for mine, theirs in zip(weights(other), weights(reference), strict=True):
        assert_close_to_scale(mine, theirs, 1e-6)
    # evaluate and predict: one row per input row, as Keras's on one device.
    trainer = keras_dp.ShardedTrainer(other, distribution=dist)
    predicted = trainer.predict(x[:7], batch_size=BATCH, verbose=0)
    assert predicted.shape == (7, 4)
    assert_close_to_scale(predicted, other(x[:7], training=False), 1e-5)
    loss, mae = trainer.evaluate(x[:7], y[:7], batch_size=BATCH, verbose=0)
    expected = np.mean((np.asarray(other(x[:7], training=False)) - y[:7]) ** 2)
    assert loss == pytest.approx(float(expected), rel=1e-5)


def test_a_model_keras_dp_builds_is_built_in_the_distributions_layouts():
    dist = distribution()
    model = keras.Sequential([keras.layers.Dense(32, name="up"), keras.layers.Dense(4, name="down")])
    model.compile(optimizer="adam", loss="mse")  # unbuilt: the first batch builds it
    keras_dp.fit_sharded(model, *data(), batch_size=BATCH, verbose=0, distribution=dist)
    assert model.get_layer("up").kernel.value.sharding.spec == P("batch", "model")
    assert model.get_layer("down").kernel.value.sharding.spec == P("model", None)


def test_a_layout_map_key_that_matches_nothing_is_reported_by_name_or_refused_when_strict():
    dist = distribution({".*up/kernel": (None, "model"), ".*up/kernal": ("model", None)})
    x, y = data()
    model = mlp(dist, width=1024)  # down/kernel (1024, 4): left whole, and large
    with pytest.warns(keras_dp.LayoutWarning) as record:
        keras_dp.fit_sharded(model, x, y, batch_size=BATCH, verbose=0, distribution=dist)
    messages = [str(warning.message) for warning in record]
    assert any(r"key(s) ['.*up/kernal'] match no variable" in m and "up/kernel" in m
               for m in messages), messages
    assert any("leaves 1 large weight(s) whole on every device: " in m
               and "down/kernel (1024, 4)" in m for m in messages), messages
    strict = mlp(dist, width=1024)
    before = weights(strict)
    with warnings.catch_warnings():
        warnings.simplefilter("error", keras_dp.LayoutWarning)
        with pytest.raises(keras_dp.LayoutWarning, match="up/kernal"):
            keras_dp.fit_sharded(strict, x, y, batch_size=BATCH, verbose=0, distribution=dist)
    for mine, theirs in zip(weights(strict), before, strict=True):  # refused before any step
        np.testing.assert_array_equal(mine, theirs)


def test_a_layout_that_does_not_divide_is_refused_naming_variable_dimension_and_axis():
    # Created with no distribution (under it, JAX itself refuses to place it).
    narrow = mlp(width=3)  # down/kernel (3, 4)
    before = weights(narrow)
    with pytest.raises(ValueError, match=r"The layout \('model', None\) of "
                                         r"down/kernel \(shape \(3, 4\)\) splits dimension 0 "
                                         r"over \['model'\] \(2 parts\), which does not divide "
                                         r"its size 3.*None leaves a dimension whole"):
        keras_dp.fit_sharded(narrow, *data(), batch_size=BATCH, verbose=0,
                             distribution=distribution({".*down/kernel": ("model", None)}))
    for mine, theirs in zip(weights(narrow), before, strict=True):
        np.testing.assert_array_equal(mine, theirs)


def test_lora_trains_with_frozen_weights_split_and_only_lora_weights_in_the_optimizer():
    dist = distribution()
    x, y = data()
    model = mlp(dist)
    with dist.scope():  # as Gemma's guide does: LoRA weights made on the mesh too
        model.get_layer("up").enable_lora(2)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    up = model.get_layer("up")
    frozen = np.asarray(up._kernel)  # `kernel` is the merged kernel under LoRA
    keras_dp.fit_sharded(model, x, y, batch_size=BATCH, epochs=2, verbose=0, distribution=dist)
    assert up._kernel.value.sharding.spec == P("batch", "model")  # frozen, still split
    np.testing.assert_array_equal(np.asarray(up._kernel), frozen)
    assert not np.allclose(np.asarray(up.lora_kernel_b), 0)  # trained (it starts at zero)
    slots = [v.path for v in model.optimizer.variables][2:]
    trainable = [v.path for v in model.trainable_variables]
    assert sorted(p.split("/", 1)[1] for p in slots) == sorted(
        f"{path.replace('/', '_')}_{slot}" for path in trainable
        for slot in ("momentum", "velocity"))
    assert any("lora_kernel" in path for path in trainable)


def test_a_distribution_with_devices_another_kind_or_a_missing_batch_axis_is_refused():
    x, y = data()
    with pytest.raises(ValueError, match=r"either `distribution` or `devices`, not both"):
        keras_dp.ShardedTrainer(mlp(), distribution=distribution(), devices=devices(4))

    class Mine(keras.distribution.DataParallel.__mro__[1]):  # a Distribution of its own
        pass

    with pytest.raises(ValueError, match=r"ModelParallel or DataParallel. Received: a Mine"):
        keras_dp.ShardedTrainer(mlp(), distribution=object.__new__(Mine))
    with pytest.raises(ValueError, match=r"batch_dim_name 'data' is not an axis of its device "
                                         r"mesh \{'batch': 2, 'model': 2\}"):
        keras_dp.ShardedTrainer(mlp(), distribution=distribution(batch_dim_name="data"))
    # Across processes: refused up front (not tested yet).
    from keras_dp.keras import layouts

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(layouts.sharding, "spans_processes", lambda mesh: True)
        with pytest.raises(ValueError, match=r"within one process only.*mesh \{'batch': 2, "
                                             r"'model': 2\} over 1 processes"):
            keras_dp.ShardedTrainer(mlp(), distribution=distribution())
    # A DataParallel: its devices, keras_dp's exact uneven split.
    parallel = keras.distribution.DataParallel(devices=devices(3))
    trainer = keras_dp.ShardedTrainer(mlp(), distribution=parallel)
    assert trainer.num_devices == 3 and trainer.layout.bases is None
    trainer.fit(x, y, batch_size=BATCH, verbose=0)


def test_memory_plan_equals_the_bytes_placed_on_device_0_per_group():
    dist = distribution({".*up/kernel": (None, "model"), ".*down/kernel": ("model", None)})
    x, y = data()
    for mode in ("replicated", "optimizer", "full"):
        model = mlp(dist, width=4096)  # up/kernel (8, 4096), down/kernel (4096, 4)
        trainer = keras_dp.ShardedTrainer(model, distribution=dist, state_sharding=mode)
        plan = trainer.memory_plan(x, y, batch_size=BATCH)
        state = trainer.init_state()
        on_device_0 = {
            name: sum(shard.data.nbytes for value in values for shard in value.addressable_shards
                      if shard.device == devices(1)[0])
            for name, values in state.groups()}
        assert on_device_0 == {"trainable": plan.weights, "non_trainable": plan.non_trainable,
                               "optimizer": plan.optimizer, "metrics": plan.metrics}, mode
        by_group = {}
        for variable in plan.variables:
            by_group[variable.group] = by_group.get(variable.group, 0) + variable.bytes
        assert by_group["trainable"] == plan.weights and by_group["optimizer"] == plan.optimizer
        up = next(v for v in plan.variables if v.path.endswith("up/kernel"))
        assert up.spec == ((None, "model") if mode != "full" else ("batch", "model"))
        assert up.bytes == 8 * 4096 * 4 // (2 if mode != "full" else 4)
        assert "mesh batch=2, model=2" in str(plan) and "up/kernel" in str(plan)
    text = trainer.describe()
    assert ("Mesh: 4 device(s), 'batch' 2, 'model' 2, platform cpu; each batch is split along "
            "'batch' and replicated along 'model'\n  batch 0: cpu:0, cpu:1\n"
            "  batch 1: cpu:2, cpu:3") in text
    assert re.search(r"trainable\s+up/kernel\s+\(8, 4096\)\s+float32\s+"
                     r"PartitionSpec\('batch', 'model'\)\s+32.0 KiB", text), text


class SigtermAt(keras.callbacks.Callback):
    def __init__(self, epoch, batch):
        super().__init__()
        self.at = (epoch, batch)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_mid_epoch_on_a_2x2_mesh_resumes_bitwise_as_the_unbroken_run(tmp_path):
    dist = distribution()
    x, y = data()

    def fit(model, **keywords):
        return keras_dp.fit_sharded(model, x, y, batch_size=BATCH, epochs=3, verbose=0,
                                    distribution=dist, **keywords)

    unbroken = mlp(dist)
    unbroken_history = fit(unbroken)
    with pytest.raises(SystemExit) as exit_info:
        fit(mlp(dist), checkpoint_dir=tmp_path, callbacks=[SigtermAt(1, 2)])
    assert exit_info.value.code == 143
    resumed = mlp(dist, seed=7)
    history = fit(resumed, checkpoint_dir=tmp_path)
    assert history.epoch == [1, 2]
    for mine, theirs in zip(weights(resumed), weights(unbroken), strict=True):
        np.testing.assert_array_equal(mine, theirs)
    np.testing.assert_array_equal(history.history["loss"], unbroken_history.history["loss"][1:])
    assert resumed.get_layer("up").kernel.value.sharding.spec == P("batch", "model")
