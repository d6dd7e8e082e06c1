"""Checkpoints of a split training state: saved as it lies, restored onto any layout."""

import sys

import jax
import keras
import numpy as np
import pytest

import keras_dp
from keras_dp.checkpoint import store as checkpoint_lib
from keras_dp import sharding
from conftest import devices
from conftest import mlp

ROWS, BATCH = 256, 64  # 4 steps per epoch


@pytest.fixture
def data(mnist):
    (x, y), _ = mnist
    return x[:ROWS].astype("float32"), y[:ROWS]


def fit(model, data, **kwargs):
    kwargs = dict(dict(batch_size=BATCH, epochs=1, verbose=0, devices=devices(4),
                       state_sharding="full"), **kwargs)
    return keras_dp.fit_sharded(model, *data, **kwargs)


@pytest.fixture
def handed_to_orbax(monkeypatch):
    """The trees `Checkpoints.save` hands to orbax, in order."""
    import orbax.checkpoint as ocp

    trees, standard_save = [], ocp.args.StandardSave
    monkeypatch.setattr(ocp.args, "StandardSave",
                        lambda tree: trees.append(tree) or standard_save(tree))
    return trees


def model_values(model):
    return [np.asarray(v.value) for _, group in
            keras_dp.TrainState.variables_of(model).groups() for v in group]


def restore(directory, model, mesh, mode):
    shardings = sharding.Layout(mesh, mode).state_shardings(keras_dp.TrainState.variables_of(model))
    checkpoints = checkpoint_lib.Checkpoints(directory, lock=False)
    try:
        return checkpoints.restore_state(checkpoint_lib.abstract_state(model, shardings), seed=0)
    finally:
        checkpoints.close()


def test_a_full_state_is_saved_split_and_restores_bitwise_onto_2_devices_either_way(
        data, tmp_path, handed_to_orbax):
    model = mlp(dropout=0.25)
    fit(model, data, checkpoint_dir=tmp_path)
    (tree,) = handed_to_orbax
    kernel, adam_slot = tree["state"]["trainable"][0], tree["state"]["optimizer"][2]
    for array in (kernel, adam_slot):  # (784, 32), split in 4 row blocks, one per device
        assert array.shape == (784, 32) and not array.sharding.is_fully_replicated
        assert sorted(s.data.nbytes for s in array.addressable_shards) == [196 * 32 * 4] * 4
    arrays = jax.tree.leaves(tree["state"])
    total = sum(a.nbytes for a in arrays)
    # Device 0 holds a quarter of the big arrays and the small ones whole.
    assert sum(sharding.bytes_per_device(a) for a in arrays) < 0.3 * total
    # The model holds the saved state (fit wrote it back at its end).
    saved = model_values(model)
    for mode in ("replicated", "full"):
        mesh = sharding.make_mesh(devices(2))
        state, position = restore(tmp_path, model, mesh, mode)  # its shapes only
        assert position == checkpoint_lib.Position(1, 0)
        restored = jax.tree.leaves(state)
        assert len(restored) == len(saved)
        for mine, reference in zip(restored, saved):
            np.testing.assert_array_equal(np.asarray(mine), reference)
        kernel = state.trainable[0]
        assert kernel.sharding.mesh.devices.size == 2
        assert kernel.sharding.is_fully_replicated == (mode == "replicated")


class SetLearningRate(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        self.model.optimizer.learning_rate.assign(0.25)


def test_a_callback_that_changed_the_model_is_saved_not_the_stale_live_state(
        data, tmp_path, handed_to_orbax):
    model = mlp()
    fit(model, data, checkpoint_dir=tmp_path, devices=devices(2),
        state_sharding="optimizer", callbacks=[SetLearningRate()])
    state, _ = restore(tmp_path, model, sharding.make_mesh(devices(2)), "optimizer")
    names = [v.path for v in model.optimizer.variables]
    rate = np.asarray(state.optimizer[names.index(model.optimizer._learning_rate.path)])
    assert rate == np.float32(0.25)
    for mine, reference in zip(jax.tree.leaves(state), model_values(model)):
        np.testing.assert_array_equal(np.asarray(mine), reference)


SAVE_SPLIT = """
import os, sys
os.environ.setdefault("KERAS_BACKEND", "jax")
import keras, numpy as np
import keras_dp
from keras_dp import distributed
distributed.initialize()
import sys

import jax
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128), keras.layers.Dense(1)])
model.compile(optimizer="adam", loss="mse")
rows = np.random.default_rng(jax.process_index()).random((64, 65), dtype=np.float32)
trainer = keras_dp.ShardedTrainer(model, state_sharding="full")
trainer.fit(rows[:, :64], rows[:, 64:], batch_size=32, epochs=1, shuffle=False,
            verbose=0, checkpoint_dir=sys.argv[1])
if jax.process_index() == 0:
    np.savez(sys.argv[2], *[np.asarray(v.value) for group in
                            keras_dp.TrainState.variables_of(model) for v in group])
"""


@pytest.mark.slow  # 93 s on the loaded 2-core VM; the split save in one process runs in CI
def test_two_processes_each_write_their_own_shards_and_one_process_restores_them(tmp_path):
    from test_distributed import run

    script = tmp_path / "save_split.py"
    script.write_text(SAVE_SPLIT)
    directory, saved = tmp_path / "checkpoints", tmp_path / "saved.npz"
    code, output = run([sys.executable, "-m", "keras_dp", "launch", "--processes", "2",
                        "--cpu-devices", "2", "--", sys.executable, str(script),
                        str(directory), str(saved)])
    assert code == 0, output[-3000:]
    written = {}  # bytes per writer: orbax's OCDBT files, one folder per process
    for path in (directory / "0").rglob("*"):
        owner = next((part for part in path.parts if part.startswith("ocdbt.process_")), None)
        if owner is not None and path.is_file():
            written[owner] = written.get(owner, 0) + path.stat().st_size
    split_bytes = 3 * 64 * 128 * 4  # the kernel and Adam's two slots, split in 4
    # Each process wrote the half its 2 devices hold; process 0 also the
    # small replicated arrays. Gathered, process 1 would write nothing.
    print(f"orbax files written per process: {written} bytes, "
          f"for {split_bytes} bytes of split arrays")  # README quotes these (-s)
    assert set(written) == {"ocdbt.process_0", "ocdbt.process_1"}, written
    for nbytes in written.values():
        assert 0.4 * split_bytes < nbytes < 0.6 * split_bytes, written
    # One process of 2 devices reads what 2 processes of 2 wrote, bitwise.
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    trainer = keras_dp.ShardedTrainer(model, devices=devices(2))
    trainer.build((np.zeros((2, 64), "float32"), np.zeros((2, 1), "float32")))
    checkpoints = checkpoint_lib.Checkpoints(directory, lock=False)
    try:
        state, position = checkpoints.restore_state(
            checkpoint_lib.abstract_state(model, trainer.state_layout()), seed=0)
    finally:
        checkpoints.close()
    assert position == checkpoint_lib.Position(1, 0)
    reference = np.load(saved)
    restored = jax.tree.leaves(state)
    assert len(restored) == len(reference.files)
    for mine, name in zip(restored, reference.files):
        np.testing.assert_array_equal(np.asarray(mine), reference[name])


def test_the_checksum_is_the_same_however_an_array_is_split_and_finds_one_changed_bit():
    from keras_dp.checkpoint import integrity as guard

    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((64, 24)).astype(dtype) for dtype in ("float32", "float16")]
    arrays += [rng.integers(-100, 100, (16, 8), dtype=np.int8), rng.random(40) > 0.5,
               np.asarray(7, np.uint32)]
    tree = {"state": {"x": arrays}, "position": {"epoch": np.asarray(2)}}
    whole = guard.bitsums(tree)
    assert whole.dtype == np.uint32 and len(np.unique(whole)) == len(whole)
    for count in (2, 8):
        mesh = sharding.make_mesh(devices(count))
        # Rows split over the devices (every leading size divides by 8).
        split = [jax.device_put(a, sharding.Layout(mesh).batch) if a.ndim
                 else jax.device_put(a, sharding.replicated(mesh)) for a in arrays]
        assert split[0].addressable_shards[0].data.shape == (64 // count, 24)
        np.testing.assert_array_equal(
            guard.bitsums({"state": {"x": split}, "position": tree["position"]}), whole)
    flipped = arrays[0].copy()
    flipped.view(np.uint32)[40, 3] ^= 1 << 9
    changed = guard.bitsums({"state": {"x": [flipped] + arrays[1:]},
                             "position": tree["position"]}) != whole
    names = [name for name, _ in guard.leaves(tree)]
    assert [name for name, bad in zip(names, changed) if bad] == ["['state']['x'][0]"]
