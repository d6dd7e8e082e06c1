"""Sharded training state (`keras_dp.sharding`, `state_sharding=`): same steps, 1/N bytes."""

import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

import keras_dp
from keras_dp import sharding
from conftest import NO_GRADIENT, assert_close_to_scale, convnet, devices, mlp, weights

SCRIPT = pathlib.Path(__file__).parent / "scripts" / "equivalence.py"


def test_the_split_axis_is_the_largest_that_divides_and_small_variables_stay_whole():
    mesh = keras_dp.make_mesh(devices(4))
    spec = lambda shape, dtype="float32": tuple(  # noqa: E731
        sharding.Layout(mesh).variable_sharding(shape, dtype).spec)
    assert spec((3, 3, 24, 32)) == (None, None, None, "batch")  # 32 > 24, both divide
    assert spec((1152, 10)) == ("batch", None)  # 10 does not divide by 4
    assert spec((30, 10, 15)) == ()  # nothing divides (4,500 values): kept whole
    assert spec((256,)) == ()  # small: a bias
    assert spec((4096, 4), "int32") == ()  # never an integer (step counts, seeds)
    assert tuple(sharding.Layout(mesh).variable_sharding((4096, 4), "float32", split=False).spec) == ()



def bfloat16_model():
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)),
                              keras.layers.Dense(128, activation="tanh", dtype="bfloat16"),
                              keras.layers.Dense(4, dtype="bfloat16")])
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_a_bfloat16_models_weights_and_slots_are_split_like_float32_ones():
    # numpy's issubdtype counts no ml_dtypes type as floating: a "bfloat16"
    # model's state stayed whole on every device under "full".
    mesh = keras_dp.make_mesh(devices(4))
    for dtype in ("bfloat16", "float16", "float8_e4m3fn"):
        assert tuple(sharding.Layout(mesh).variable_sharding((64, 128), dtype).spec) == (None, "batch")
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((64, 64)).astype("float32"), rng.integers(0, 4, 64)
    trainer = keras_dp.ShardedTrainer(bfloat16_model(), devices=devices(4), state_sharding="full")
    trainer.build((x[:16], y[:16]))
    state = trainer.init_state()
    kernel, momentum = state.trainable[0], state.optimizer[2]  # (64, 128): split in 4
    for array in (kernel, momentum):
        assert array.dtype == "bfloat16" and tuple(array.sharding.spec) == (None, "batch")
    held = {name: sum(s.data.nbytes for v in values for s in v.addressable_shards
                      if s.device == devices(1)[0]) for name, values in state.groups()}
    plan = keras_dp.memory_plan(bfloat16_model(), x[:4], y[:4], batch_size=16,
                                devices=devices(4), state_sharding="full")
    assert held["trainable"] == plan.weights == 2 * (64 * 128 // 4 + 128 + 128 * 4 + 4)
    assert held["optimizer"] == plan.optimizer


def test_a_bfloat16_model_trained_split_equals_replicated_to_bfloat16_rounding():
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((64, 64)).astype("float32"), rng.integers(0, 4, 64)
    models = {mode: bfloat16_model() for mode in ("replicated", "full")}
    for mode, model in models.items():
        keras_dp.fit_sharded(model, x, y, batch_size=16, epochs=1, shuffle=False, verbose=0,
                             devices=devices(4), state_sharding=mode)
    for a, b in zip(weights(models["full"]), weights(models["replicated"])):
        assert_close_to_scale(a.astype("float32"), b.astype("float32"), 2 ** -6)


@pytest.mark.slow  # the float64 test below checks the same, stricter
def test_each_mode_trains_the_same_steps_as_replicated_in_float32(mnist):
    (x, y), _ = mnist
    x, y = x[:150], y[:150]  # batches of 50 rows: 50 does not divide by 4
    histories, models = {}, {}
    for mode in ("replicated", "optimizer", "full"):
        models[mode] = convnet()
        histories[mode] = keras_dp.fit_sharded(
            models[mode], x, y, batch_size=50, epochs=1, shuffle=False, verbose=0,
            devices=devices(4), state_sharding=mode, steps_per_execution=2,
            validation_data=(x[:30], y[:30])).history
    for mode in ("optimizer", "full"):
        for key in ("loss", "val_loss", "accuracy"):
            np.testing.assert_allclose(histories[mode][key], histories["replicated"][key],
                                       rtol=1e-5)
        for a, b in zip(models["replicated"].variables, models[mode].variables):
            if a.path.endswith(NO_GRADIENT.split("/")[0] + "/bias"):
                continue  # rounding noise on any device count (see conftest)
            a, b = np.asarray(a.value, np.float64), np.asarray(b.value, np.float64)
            assert_close_to_scale(b, a, scale=1e-4)


@pytest.mark.slow  # 20 s: moved out of CI to keep the default run under 10 minutes
def test_float64_every_mode_equals_one_device_to_rounding():
    """10 steps, Dropout and BatchNorm, layers of 10 and 30 units: each mode, each optimizer.

    Adam's two slots split under "full", SGD's momentum under "optimizer"
    (the other two pairs repeat these layouts at twice the time).
    """
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--float64", "--steps", "10", "--devices", "4",
         "--model", "odd", "--pairs", "adam:full,sgd:optimizer"],
        capture_output=True, text=True, timeout=400, env=dict(os.environ),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    runs = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [(r["optimizer"], r["state_sharding"]) for r in runs] == [
        ("adam", "full"), ("sgd", "optimizer")]
    for run in runs:
        np.testing.assert_allclose(run["losses_n"], run["losses_1"], rtol=1e-12)
        worst = max(run["relative_difference"].values())
        assert worst <= 1e-10, (run["optimizer"], run["state_sharding"], worst)


def _state_bytes(trainer):
    state = trainer.init_state()
    return {name: (sum(sharding.bytes_per_device(v) for v in values),
                   sum(v.nbytes for v in values if v.sharding.is_fully_replicated))
            for name, values in state.groups()}


@pytest.mark.parametrize("mode", ["optimizer", "full"])
def test_bytes_per_device_are_a_1_over_n_share_plus_what_stays_whole(mnist, mode):
    (x, y), _ = mnist
    replicated = keras_dp.ShardedTrainer(convnet(), devices=devices(4))
    replicated.build((x[:8], y[:8]))
    split = keras_dp.ShardedTrainer(convnet(), devices=devices(4), state_sharding=mode)
    split.build((x[:8], y[:8]))
    whole, parts = _state_bytes(replicated), _state_bytes(split)
    groups = ("optimizer",) if mode == "optimizer" else ("trainable", "optimizer")
    for group in groups:
        per_device, kept_whole = parts[group]
        assert per_device <= whole[group][0] / 4 + kept_whole, group
        assert per_device < 0.4 * whole[group][0], group  # the convnet: most bytes split
    if mode == "optimizer":
        assert parts["trainable"] == whole["trainable"]
    assert "split over 'batch'" in split.describe()


@pytest.mark.parametrize("mode", [pytest.param("optimizer", marks=pytest.mark.slow), "full"])
def test_the_compiled_step_gathers_what_is_split(mnist, mode):
    (x, y), _ = mnist
    trainer = keras_dp.ShardedTrainer(convnet(), devices=devices(4), state_sharding=mode)
    batch = (x[:64], y[:64])
    trainer.build(batch)
    hlo = trainer.compiled_train_step(trainer.init_state(), trainer.shard(batch)).as_text()
    gathered = re.findall(r"= (f32\[[\d,]+\])\S* all-gather", hlo)
    # The conv kernels (6x6x24x32 is split along 32) come back whole after the update.
    assert any(shape.startswith("f32[6,6,24,32") for shape in gathered), gathered
    if mode == "full":  # and before the forward pass: more gathers than "optimizer"
        assert len(gathered) > 3


def test_optimizer_mode_sums_gradients_by_all_reduce_and_slice_on_xla_cpu(mnist):
    # What XLA's SPMD partitioner makes of the gradients constrained to the
    # split layout: an all-reduce of the whole gradient, then each device's
    # slice of it (dynamic-slice). XLA's GPU pipeline fuses that pair into a
    # reduce-scatter (ReduceScatterCreator); XLA:CPU's runs no such pass and
    # has no flag for it, though it can run a reduce-scatter (below). If
    # this fails, XLA:CPU changed: update this test and README's sentence.
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec

    (x, y), _ = mnist
    trainer = keras_dp.ShardedTrainer(mlp(), devices=devices(4), state_sharding="optimizer")
    batch = (x[:64], y[:64])
    trainer.build(batch)
    hlo = trainer.compiled_train_step(trainer.init_state(), trainer.shard(batch)).as_text()
    reduced = [shape for line in hlo.splitlines() if " all-reduce(" in line
               for shape in re.findall(r"f32\[[\d,]*\]", line.split(" all-reduce(")[0])]
    sliced = re.findall(r"= (f32\[[\d,]+\])\S* dynamic-slice\(", hlo)
    # The (784, 32) kernel's gradient, computed as (32, 784): summed whole, then sliced.
    assert "f32[32,784]" in reduced and "f32[32,196]" in sliced, (reduced, sliced)
    assert "reduce-scatter" not in hlo
    # The op itself runs on XLA:CPU when written explicitly.
    mesh = trainer.mesh
    scatter = jax.jit(jax.shard_map(
        lambda g: jax.lax.psum_scatter(g, "batch", scatter_dimension=0, tiled=True),
        mesh=mesh, in_specs=PartitionSpec(), out_specs=PartitionSpec("batch")))
    whole = jax.ShapeDtypeStruct((784, 32), np.float32,
                                 sharding=NamedSharding(mesh, PartitionSpec()))
    assert re.search(r"f32\[196,32\]\S* reduce-scatter\(",
                     scatter.lower(whole).compile().as_text())


def test_a_checkpoint_of_full_on_4_devices_resumes_replicated_on_2(mnist, tmp_path):
    (x, y), _ = mnist
    x, y = x[:256], y[:256]
    options = dict(batch_size=64, shuffle=True, verbose=0)
    unbroken = mlp()
    keras_dp.fit_sharded(unbroken, x, y, epochs=2, devices=devices(2), **options)
    first = mlp()
    keras_dp.fit_sharded(first, x, y, epochs=1, devices=devices(4), state_sharding="full",
                         checkpoint_dir=tmp_path / "ckpt", **options)
    resumed = mlp(seed=1)  # other initial weights: the checkpoint replaces them
    history = keras_dp.fit_sharded(resumed, x, y, epochs=2, devices=devices(2),
                                   checkpoint_dir=tmp_path / "ckpt", **options)
    assert history.epoch == [1]
    for a, b in zip(weights(unbroken), weights(resumed)):
        assert_close_to_scale(b, a, 1e-4)  # Adam: measured 3.1e-6


def test_memory_plan_reads_the_compiled_programs_own_analysis(mnist):
    (x, y), _ = mnist
    plans = {mode: keras_dp.memory_plan(mlp(), x[:4], y[:4], batch_size=256,
                                        devices=devices(4), state_sharding=mode)
             for mode in ("replicated", "optimizer", "full")}
    replicated, optimizer, full = plans.values()
    assert replicated.optimizer == 2 * replicated.weights + 8  # Adam: 2 slots + step, lr
    assert optimizer.optimizer < replicated.optimizer / 2 and optimizer.weights == replicated.weights
    assert full.weights < replicated.weights / 2
    assert full.arguments < optimizer.arguments < replicated.arguments
    assert replicated.peak >= replicated.arguments and replicated.temporaries > 0
    assert replicated.capacity is None and replicated.fits()  # CPU reports no capacity
    assert "peak" in str(replicated)


def test_an_unknown_mode_names_the_valid_ones():
    with pytest.raises(ValueError, match="one of 'replicated', 'optimizer', 'full'.*'zero3'"):
        keras_dp.ShardedTrainer(mlp(), state_sharding="zero3")


def test_the_cli_refuses_state_sharding_with_an_ensemble(capsys):
    from keras_dp import cli

    with pytest.raises(SystemExit):
        cli.main(["train", "--ensemble", "2", "--state-sharding", "full"])
    assert "an ensemble already keeps each member" in capsys.readouterr().err


def test_a_step_over_the_devices_memory_is_a_memory_error_with_the_numbers_and_fixes(mnist):
    # README: on an accelerator fit checks the plan before the first step
    # and raises MemoryError with the numbers and the fixes. XLA:CPU reports
    # no capacity (the check passes), so the plan's capacity is set here.
    import dataclasses

    from keras_dp.diagnostics import memory

    (x, y), _ = mnist
    plan = keras_dp.memory_plan(mlp(), x[:4], y[:4], batch_size=64, devices=devices(2))
    assert plan.capacity is None and plan.fits()
    memory.check_fits(plan)  # nothing known to exceed: no error
    over = dataclasses.replace(plan, capacity=plan.peak - 1)
    with pytest.raises(MemoryError) as refused:
        memory.check_fits(over)
    message = str(refused.value)
    assert message.startswith(f"One train step needs {plan.peak / 2**30:.2f} GiB per device, "
                              f"and the device has {(plan.peak - 1) / 2**30:.2f} GiB.")
    for fix in ("state_sharding='full'", "batch_size", "mixed_bfloat16"):
        assert fix in message
