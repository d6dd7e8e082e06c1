"""Sharded from birth: a model split over a 2x2 mesh is never whole on device 0.

Device 0's bytes are summed over `jax.live_arrays()` at every creation and
assignment of a Keras variable and every `jax.device_put`
(`tests/scripts/sharded_birth.py`'s `Device0`, which also prints these
numbers for `--model dense|gemma`). Each bound is device 0's shard of what
the phase makes, plus a slack measured on Keras 3.15 / JAX 0.10 and written
here: the scalars made whole on every device (an optimizer's iteration
count and learning rate, a metric's totals), and, while a weight is
assigned, that weight's old and new shards both alive. Each test also
checks that Keras alone (`--keras-only`: the hook off) exceeds the bound,
so the bound tells the two apart.
"""

import contextlib
import gc
import importlib.util
import os
import pathlib

import jax
import numpy as np
import pytest

import keras_dp
from keras_dp import _compat
from keras_dp.checkpoint import store
from keras_dp.core.live import Position

SPEC = importlib.util.spec_from_file_location(
    "sharded_birth_script", pathlib.Path(__file__).parent / "scripts" / "sharded_birth.py")
script = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(script)

@pytest.fixture(autouse=True)
def _earlier_objects_frozen():
    # Device0 collects garbage around each phase, so that arrays already
    # dead are not counted. After the rest of the suite Python tracks
    # about 1.5 million objects, and each full collection took a second
    # (15 s a test); frozen once, the collections walk only this test's.
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


# Measured: building the dense model's layers, optimizer and metrics peaked
# 48 bytes above device 0's shard of them (the scalars); a checkpoint
# restore 12 bytes above (its position's scalars). Keras alone: 1,030,000 above.
SCALARS_SLACK = 1024


def shard_bytes(variables, device):
    """Bytes of `variables` on `device`, each as its layout splits it."""
    return sum(int(np.prod(v.value.sharding.shard_shape(v.shape))) * np.dtype(v.dtype).itemsize
               for v in variables if device in v.value.sharding.device_set)


def state_variables(model):
    return [v for group in keras_dp.TrainState.variables_of(model) for v in group]


def built(make, distribution, data, keras_only=False, monkeypatch=None):
    """`make(distribution)` built by keras_dp, and the tracker of that build."""
    if keras_only:
        monkeypatch.setattr(_compat, "sharded_birth", contextlib.nullcontext)
    model = make(distribution)
    trainer = keras_dp.ShardedTrainer(model, distribution=distribution)
    tracker = script.Device0()
    with tracker.watching():
        trainer.build(data)
    monkeypatch.undo()
    return model, trainer, tracker


def test_dense_built_loaded_set_and_restored_in_shards(tmp_path, monkeypatch):
    distribution, data = script.dense_distribution(), script.dense_data()
    device = jax.devices()[0]
    model, trainer, tracker = built(script.dense_model, distribution, data, False, monkeypatch)
    shard = shard_bytes(state_variables(model), device)
    assert shard == 3_185_872  # up's kernel 2 MiB whole, 512 KiB a device
    assert tracker.peak - tracker.before <= shard + SCALARS_SLACK
    keras_model, _, keras_tracker = built(script.dense_model, distribution, data, True, monkeypatch)
    assert keras_tracker.peak - keras_tracker.before > shard + 512 * 1024  # measured: +1,030,000
    # Created values are Keras's, bitwise (Glorot uniform and zeros), laid out alike.
    for ours, theirs in zip(model.weights, keras_model.weights, strict=True):
        assert ours.value.sharding == theirs.value.sharding, ours.path
        np.testing.assert_array_equal(np.asarray(ours.value), np.asarray(theirs.value))

    path = os.path.join(tmp_path, "model.weights.h5")
    keras_model.save_weights(path)
    values = keras_model.get_weights()
    largest_shard = max(shard_bytes([v], device) for v in model.weights)
    assert largest_shard == 512 * 1024
    for load in (lambda: model.load_weights(path), lambda: model.set_weights(values)):
        for hook, bound in ((keras_dp.sharded_birth, largest_shard),
                            (contextlib.nullcontext, None)):
            model.set_weights([np.zeros_like(v) for v in values])
            tracker = script.Device0()
            with tracker.watching(), distribution.scope(), hook():
                load()
            if bound is None:  # Keras alone: up's kernel whole on device 0 (measured 2.5 MiB)
                assert tracker.peak - tracker.before >= 4 * largest_shard
            else:  # measured: 512 KiB, up's kernel's old and new shards
                assert tracker.peak - tracker.before <= bound + SCALARS_SLACK
            assert_loaded(model, values, keras_model)
    # The plan's figure: the model as it lies plus one shard, what the loads measured.
    plan = keras_dp.memory_plan(model, *data, batch_size=8, distribution=distribution)
    assert plan.loading == shard + largest_shard == 3_710_160

    checkpoints = store.Checkpoints(os.path.join(tmp_path, "checkpoints"), lock=False)
    checkpoints.save(trainer.init_state(), Position(1, 0), trainer.seed)
    model.set_weights([np.zeros_like(v) for v in values])
    tracker = script.Device0()
    with tracker.watching():
        checkpoints.restore(model, trainer.seed)
    checkpoints.close()
    assert tracker.peak - tracker.before <= shard + SCALARS_SLACK  # the old state and the new
    assert_loaded(model, values, keras_model)


def assert_loaded(model, values, reference):
    """`model` holds `values` bitwise, each weight laid out as `reference`'s."""
    for variable, value, other in zip(model.weights, values, reference.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(variable.value), value)
        assert variable.value.sharding.spec == other.value.sharding.spec, variable.path


def test_nested_sharded_birth_restores_keras():
    from keras.src.backend.jax import core

    before = (core.should_shard_at_init, core.JaxVariable._initialize_with_initializer,
              core.JaxVariable._convert_to_tensor)
    with keras_dp.sharded_birth():
        inside = core.JaxVariable._convert_to_tensor
        with keras_dp.sharded_birth():
            assert core.JaxVariable._convert_to_tensor is inside
        assert core.JaxVariable._convert_to_tensor is inside
    assert (core.should_shard_at_init, core.JaxVariable._initialize_with_initializer,
            core.JaxVariable._convert_to_tensor) == before


# The second model is not built for training: its optimizer has no slots to load.
@pytest.mark.filterwarnings("ignore:Skipping variable loading for optimizer")
def test_gemma_built_and_loaded_from_weights_h5_in_shards(tmp_path):
    pytest.importorskip("keras_hub", reason="keras_hub is an extra")
    distribution, data = script.gemma_distribution(), script.gemma_data()
    device = jax.devices()[0]
    tracker = script.Device0()
    with tracker.watching(), keras_dp.sharded_birth():
        model = script.gemma_model(distribution)
    weights = shard_bytes(model.weights, device)
    assert weights == 330_240  # the 512 KiB embedding: 128 KiB a device
    # Measured 488 bytes above: the scalars, and a layer's seed state.
    assert tracker.peak - tracker.before <= weights + SCALARS_SLACK
    trainer = keras_dp.ShardedTrainer(model, distribution=distribution)
    tracker = script.Device0()
    with tracker.watching():
        trainer.build(data)
    state = shard_bytes(state_variables(model), device)
    assert state == 990_744
    assert tracker.peak - tracker.before <= state - weights + SCALARS_SLACK  # measured: +512

    path = os.path.join(tmp_path, "gemma.weights.h5")
    model.save_weights(path)
    values = model.get_weights()
    with keras_dp.sharded_birth():
        second = script.gemma_model(distribution)
        second.set_weights([np.zeros_like(v) for v in values])
    largest_shard = max(shard_bytes([v], device) for v in second.weights)
    assert largest_shard == 128 * 1024
    tracker = script.Device0()
    with tracker.watching(), distribution.scope(), keras_dp.sharded_birth():
        second.load_weights(path)
    assert tracker.peak - tracker.before <= largest_shard + SCALARS_SLACK  # measured: 131072
    assert_loaded(second, values, model)
