"""Checkpoint and resume, saving on SIGTERM, and stopping on a non-finite loss."""

import errno
import json
import logging
import os
import pathlib
import re
import signal
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_dp
from keras_dp.checkpoint import store as checkpoint_lib
from conftest import assert_close_to_scale
from conftest import assert_weights_equal
from conftest import devices
from conftest import mlp
from conftest import weights

ROWS, BATCH = 512, 64  # 8 steps per epoch
ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def data(mnist):
    (x, y), _ = mnist
    return x[:ROWS].astype("float32"), y[:ROWS]


def fit(model, data, **kwargs):
    kwargs = dict(dict(batch_size=BATCH, epochs=3, verbose=0, devices=devices(2)), **kwargs)
    return keras_dp.fit_sharded(model, *data, **kwargs)


def test_stop_after_epoch_1_and_resume_equals_an_unbroken_run(data, tmp_path):
    # Dropout and shuffling on, Adam: the checkpoint must carry the seed
    # generator's state and the optimizer's slots and step count.
    unbroken = mlp(dropout=0.25)
    fit(unbroken, data)
    first = mlp(dropout=0.25)
    history = fit(first, data, epochs=1, checkpoint_dir=tmp_path)
    assert history.epoch == [0]
    resumed = mlp(seed=7, dropout=0.25)  # other weights: the checkpoint replaces them
    history = fit(resumed, data, checkpoint_dir=tmp_path)
    assert history.epoch == [1, 2]
    assert_weights_equal(resumed, unbroken)
    assert int(resumed.optimizer.iterations.numpy()) == 3 * ROWS // BATCH
    # A finished run resumes to nothing more to do.
    assert fit(resumed, data, checkpoint_dir=tmp_path).epoch == []


def test_a_rerun_says_where_it_resumes_or_that_nothing_is_left(data, tmp_path, capsys):
    model = mlp()
    fit(model, data, epochs=1, checkpoint_dir=tmp_path)
    resumed = mlp(seed=7)
    history = fit(resumed, data, epochs=1, checkpoint_dir=tmp_path, verbose=2)
    assert history.epoch == [] and history.history == {}
    assert_weights_equal(resumed, model)
    assert capsys.readouterr().out == (
        f"keras_dp: the checkpoint in {tmp_path} is at the end of epoch 1, and "
        "epochs=1: nothing is left to train, and the model holds the checkpoint's "
        "weights. Pass a larger epochs to train on, or a new checkpoint_dir to start "
        "afresh.\n")
    assert fit(resumed, data, epochs=2, checkpoint_dir=tmp_path, verbose=2).epoch == [1]
    assert capsys.readouterr().out.startswith(
        f"keras_dp: resuming from the checkpoint in {tmp_path}, at the end of epoch 1.\n"
        "Epoch 2/2\n")
    fit(resumed, data, epochs=3, checkpoint_dir=tmp_path)  # verbose=0: nothing printed
    assert capsys.readouterr().out == ""


class EpochWeights(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen = []

    def on_epoch_end(self, epoch, logs=None):
        self.seen.append(weights(self.model))


def test_a_rerun_of_an_early_stopped_run_returns_its_final_weights_at_once(data, tmp_path, capsys):
    # Before: the stopped run was not marked finished, and its rerun trained
    # on (epochs 3 and 4 here) from the last epoch's weights, not the best.
    def early_stopping():  # epoch 1 is the best; epoch 2 does not improve by 10: stop
        return keras.callbacks.EarlyStopping(monitor="loss", patience=1, min_delta=10,
                                             restore_best_weights=True)

    model, record = mlp(), EpochWeights()
    history = fit(model, data, epochs=6, checkpoint_dir=tmp_path,
                  callbacks=[early_stopping(), record])
    assert history.epoch == [0, 1]
    for mine, best in zip(weights(model), record.seen[0], strict=True):
        np.testing.assert_array_equal(mine, best)  # restore_best_weights: epoch 1's
    rerun = mlp(seed=7)  # with a larger epochs too, it does not train on
    history = fit(rerun, data, epochs=10, checkpoint_dir=tmp_path, verbose=2,
                  callbacks=[early_stopping()])
    assert history.epoch == [] and history.history == {}
    assert_weights_equal(rerun, model)
    assert int(rerun.optimizer.iterations.numpy()) == 2 * ROWS // BATCH
    assert capsys.readouterr().out == (
        f"keras_dp: the run in {tmp_path} stopped early, at the end of epoch 2 (a "
        "callback set model.stop_training, e.g. EarlyStopping): nothing is left to "
        "train, and the model holds the weights that run ended with. Pass a new "
        "checkpoint_dir to train again.\n")


class RaisesOnTrainEnd(keras.callbacks.Callback):
    def on_train_end(self, logs=None):
        raise RuntimeError("a callback failed in on_train_end")


def test_a_callback_raising_in_on_train_end_still_leaves_the_best_weights_checkpointed(
        data, tmp_path):
    # Before, the save after on_train_end was skipped when a later callback
    # raised there: the checkpoint, marked stopped, held the last epoch's
    # weights, and the rerun returned them instead of EarlyStopping's best.
    model, record = mlp(), EpochWeights()
    stop = keras.callbacks.EarlyStopping(monitor="loss", patience=1, min_delta=10,
                                         restore_best_weights=True)
    with pytest.raises(RuntimeError, match="a callback failed in on_train_end"):
        fit(model, data, epochs=6, checkpoint_dir=tmp_path,
            callbacks=[stop, record, RaisesOnTrainEnd()])
    assert len(record.seen) == 2
    rerun = mlp(seed=7)
    assert fit(rerun, data, epochs=6, checkpoint_dir=tmp_path).epoch == []
    for mine, best in zip(weights(rerun), record.seen[0], strict=True):
        np.testing.assert_array_equal(mine, best)  # epoch 1's, not epoch 2's
    assert int(rerun.optimizer.iterations.numpy()) == 2 * ROWS // BATCH


@pytest.mark.slow  # 5 s: three fits
def test_a_callbacks_own_state_starts_afresh_on_resume_as_under_backup_and_restore(data, tmp_path):
    # Keras's BackupAndRestore saves the weights and the epoch, not the
    # callbacks' state; nor does checkpoint_dir. EarlyStopping's `best` and
    # `wait` restart, so the resumed run stops one epoch later.
    def early_stopping():  # epoch 1 is the best; the next does not improve by 10: stop
        return keras.callbacks.EarlyStopping(monitor="loss", patience=1, min_delta=10)

    assert fit(mlp(), data, epochs=6, callbacks=[early_stopping()]).epoch == [0, 1]
    assert fit(mlp(), data, epochs=1, checkpoint_dir=tmp_path).epoch == [0]
    stop = early_stopping()
    assert fit(mlp(), data, epochs=6, checkpoint_dir=tmp_path, callbacks=[stop]).epoch == [1, 2]
    assert stop.stopped_epoch == 2


@pytest.mark.slow
def test_a_checkpoint_of_full_sharding_on_4_devices_resumes_replicated_on_2(data, tmp_path):
    # Saved split as the state lies, read into the model and laid out anew:
    # another device count and state_sharding resume the same run.
    unbroken = mlp(dropout=0.25)
    fit(unbroken, data, epochs=2)
    first = mlp(dropout=0.25)
    fit(first, data, epochs=1, checkpoint_dir=tmp_path, devices=devices(4),
        state_sharding="full")
    resumed = mlp(seed=7, dropout=0.25)
    assert fit(resumed, data, epochs=2, checkpoint_dir=tmp_path).epoch == [1]
    assert int(resumed.optimizer.iterations.numpy()) == 2 * ROWS // BATCH
    # 4 devices then 2 sum the gradients in another order: rounding apart.
    for mine, reference in zip(weights(resumed), weights(unbroken), strict=True):
        assert_close_to_scale(mine, reference, scale=1e-4)


class SigtermAt(keras.callbacks.Callback):
    def __init__(self, epoch, batch):
        super().__init__()
        self.at = (epoch, batch)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_mid_epoch_saves_exits_and_resumes_exactly(data, tmp_path):
    unbroken = mlp(dropout=0.25)
    unbroken_history = fit(unbroken, data)
    model = mlp(dropout=0.25)
    with pytest.raises(SystemExit) as exit_info:
        fit(model, data, checkpoint_dir=tmp_path, callbacks=[SigtermAt(1, 4)])
    assert exit_info.value.code == 143
    # The handler is gone again: SIGTERM has its previous meaning.
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    # Saved after 5 steps of epoch 1 (batches 0-4), metrics' totals included.
    resumed = mlp(seed=7, dropout=0.25)
    history = fit(resumed, data, checkpoint_dir=tmp_path)
    assert history.epoch == [1, 2]
    assert_weights_equal(resumed, unbroken)
    np.testing.assert_array_equal(history.history["loss"], unbroken_history.history["loss"][1:])


def test_a_mid_epoch_checkpoint_refuses_another_batch_size_shuffle_or_data(data, tmp_path):
    # Its steps done count batches of the interrupted fit: under another
    # batch size, shuffle or data they would mean other rows.
    with pytest.raises(SystemExit):
        fit(mlp(), data, epochs=2, checkpoint_dir=tmp_path, callbacks=[SigtermAt(1, 4)])
    x, y = data
    start = (f"The checkpoint in {tmp_path} stopped after 5 steps of epoch 2 of a fit with ")
    end = (": the rest of that epoch would train on other rows than the interrupted "
           "run's. Rerun with the same data, batch_size and shuffle to finish that run, "
           "or pass a new checkpoint_dir to start afresh.")
    for change, was, now in [
            (dict(batch_size=32), "batch_size=64", "batch_size=32"),
            (dict(shuffle="batch"), "shuffle=True", "shuffle='batch'"),
            (dict(data=(x[:448], y[:448])), "512 rows of training data",
             "448 rows of training data")]:
        with pytest.raises(ValueError) as refused:
            fit(mlp(), change.pop("data", data), epochs=2, checkpoint_dir=tmp_path, **change)
        assert str(refused.value) == f"{start}{was}, and this fit has {now}{end}"
    # A dataset's batches: their row count is compared.
    def batches(size):
        return [(x[i:i + size], y[i:i + size]) for i in range(0, ROWS, size)]

    with pytest.raises(SystemExit):
        keras_dp.fit_sharded(mlp(), batches(64), epochs=2, verbose=0, devices=devices(2),
                             checkpoint_dir=tmp_path / "dataset", callbacks=[SigtermAt(1, 4)])
    with pytest.raises(ValueError, match=r"with batch_size=64, and this fit has batch_size=32:"):
        keras_dp.fit_sharded(mlp(), batches(32), epochs=2, verbose=0, devices=devices(2),
                             checkpoint_dir=tmp_path / "dataset")


def save_as_if_by(directory, processes, position, data, source=None):
    """A checkpoint of `mlp()` at `position`, marked as written by `processes` processes of 2 devices."""
    model = mlp()
    trainer = keras_dp.ShardedTrainer(model, devices=devices(2))
    trainer.build((data[0][:8], data[1][:8]))
    topology = {"processes": processes, "devices": 2 * processes, "local_batch": BATCH // processes}
    with checkpoint_lib.closing(checkpoint_lib.Checkpoints(
            directory, source=source, topology=topology)) as saved:
        saved.save(trainer.init_state(), position, seed=0)


def test_a_mid_epoch_checkpoint_of_another_process_count_is_refused_naming_both(data, tmp_path):
    # Each process reads its own share, shuffled on its own: the steps done
    # in an epoch by 2 processes took other rows than the same steps of 1.
    save_as_if_by(tmp_path, 2, checkpoint_lib.Position(1, 5), data)
    with pytest.raises(ValueError) as refused:
        fit(mlp(), data, checkpoint_dir=tmp_path)
    assert str(refused.value) == (
        f"The checkpoint in {tmp_path} stopped after 5 steps of epoch 2, written by "
        "2 processes of 2 devices each, a global batch of 64 rows (32 on process 0), "
        "and this fit runs on 1 process of 2 devices, a batch of 64 rows: each "
        "process's share of the data would not be the one it left, so the rest of "
        "that epoch would train on other rows than the interrupted run's (some twice, "
        "some never). Resume on 2 processes to finish that epoch (from its end, a run "
        "can go on with any number), or resume from the checkpoint kept before it "
        "(none is kept here), or pass a new checkpoint_dir to start afresh. To resume "
        "inside an epoch on any number of processes, pass the same whole arrays on every "
        "process (keras_dp takes each process's part of every global batch), or read Grain "
        "through grain.experimental.ElasticIterator (see the docs: guides/preemption).")
    # Saved at an epoch's end, it resumes on any number: the next epoch starts afresh.
    other = tmp_path / "at an epoch's end"
    save_as_if_by(other, 2, checkpoint_lib.Position(1, 0), data)
    assert fit(mlp(), data, epochs=2, checkpoint_dir=other).epoch == [1]


def test_a_backup_and_restore_beside_a_checkpoint_dir_is_refused_before_anything_is_written(
        data, tmp_path):
    # Each restored a rerun from its own point. After a SIGTERM after 3
    # steps of epoch 2 (the backup at epoch 1's end), the rerun skipped 3
    # steps from the backup's weights (21 steps of 24); after a crash past
    # a backup every 2 batches, it retrained them (26 of 24).
    model = mlp()
    before = weights(model)
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"), save_freq=2)
    message = (
        "checkpoint_dir and keras.callbacks.BackupAndRestore both restore a rerun of this "
        "fit, each from its own point (the checkpoint after the last step saved, the backup "
        "at the start of its epoch), so together a rerun would train some batches twice or "
        f"skip others. Received: checkpoint_dir='{tmp_path / 'ckpt'}' and callbacks[1]="
        f"BackupAndRestore(backup_dir='{tmp_path / 'backup'}'). Pass one: checkpoint_dir "
        "alone resumes exactly where the run stopped, mid-epoch too; BackupAndRestore alone "
        "restarts the epoch of its backup, as under model.fit.")
    for callbacks in ([keras.callbacks.History(), backup],
                      keras.callbacks.CallbackList([keras.callbacks.History(), backup])):
        with pytest.raises(ValueError) as refused:
            fit(model, data, checkpoint_dir=tmp_path / "ckpt", callbacks=callbacks)
        assert str(refused.value) == message
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "backup").exists()
    for now, was in zip(weights(model), before, strict=True):
        np.testing.assert_array_equal(now, was)
    # Each alone still trains.
    assert fit(model, data, epochs=1, callbacks=[backup]).epoch == [0]
    assert fit(model, data, epochs=1, checkpoint_dir=tmp_path / "ckpt").epoch == [0]


def test_sigterm_during_a_save_leaves_it_complete(data, tmp_path, monkeypatch):
    save = checkpoint_lib.Checkpoints.save

    def signalled_save(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # arrives while this save runs
        return save(self, *args, **kwargs)

    monkeypatch.setattr(checkpoint_lib.Checkpoints, "save", signalled_save)
    model = mlp()
    with pytest.raises(SystemExit):
        fit(model, data, checkpoint_dir=tmp_path)
    monkeypatch.undo()
    # The save at the end of epoch 0 completed, and the run stopped there.
    assert sorted(os.listdir(tmp_path)) == [".keras_dp.lock", "0"]
    assert (tmp_path / "0" / "commit_success.txt").exists() or (tmp_path / "0" / "_CHECKPOINT_METADATA").exists()
    resumed = mlp(seed=7)
    assert fit(resumed, data, epochs=1, checkpoint_dir=tmp_path).epoch == []
    assert_weights_equal(resumed, model)


def test_ctrl_c_during_a_save_waits_for_it_to_complete(data, tmp_path, monkeypatch):
    # Before, the KeyboardInterrupt landed inside orbax's write: the epoch's
    # checkpoint was dropped (a rerun trained that epoch again), or, in its
    # cleanup, an older one was left beyond checkpoints_to_keep.
    bitsums = checkpoint_lib.guard.bitsums

    def interrupted_bitsums(tree):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, while a save runs
        return bitsums(tree)

    monkeypatch.setattr(checkpoint_lib.guard, "bitsums", interrupted_bitsums)
    model = mlp()
    with pytest.raises(KeyboardInterrupt) as interrupted:
        fit(model, data, checkpoint_dir=tmp_path)
    monkeypatch.undo()
    assert interrupted.value.__notes__ == [
        "keras_dp: the model holds the weights after 8 steps of epoch 1, "
        "the last step that completed."]
    # The save at the end of epoch 1 completed; a rerun goes on from it.
    assert sorted(os.listdir(tmp_path)) == [".keras_dp.lock", "0"]
    resumed = mlp(seed=7)
    assert fit(resumed, data, epochs=1, checkpoint_dir=tmp_path).epoch == []
    assert_weights_equal(resumed, model)


def test_ctrl_c_during_the_save_after_an_early_stop_waits_for_it(data, tmp_path, monkeypatch):
    # The save after on_train_end (the best weights EarlyStopping restored)
    # ran outside the fit's hold on Ctrl-C: interrupted, the rerun returned
    # epoch 2's weights instead of epoch 1's.
    save, saves, bitsums = checkpoint_lib.Checkpoints.save, [], checkpoint_lib.guard.bitsums

    def recorded_save(self, *args, **kwargs):
        saves.append(args[1])
        return save(self, *args, **kwargs)

    def interrupted_bitsums(tree):
        if len(saves) == 3:  # epochs 1 and 2, then the run's end: Ctrl-C while it saves
            os.kill(os.getpid(), signal.SIGINT)
        return bitsums(tree)

    monkeypatch.setattr(checkpoint_lib.Checkpoints, "save", recorded_save)
    monkeypatch.setattr(checkpoint_lib.guard, "bitsums", interrupted_bitsums)
    model, record = mlp(), EpochWeights()
    with pytest.raises(KeyboardInterrupt):
        fit(model, data, epochs=6, checkpoint_dir=tmp_path, callbacks=[
            keras.callbacks.EarlyStopping(monitor="loss", patience=1, min_delta=10,
                                          restore_best_weights=True), record])
    monkeypatch.undo()
    assert saves[2] == checkpoint_lib.Position(2, 0, stopped=True)
    rerun = mlp(seed=7)
    assert fit(rerun, data, epochs=6, checkpoint_dir=tmp_path).epoch == []
    for mine, best in zip(weights(rerun), record.seen[0], strict=True):
        np.testing.assert_array_equal(mine, best)


def test_a_partly_written_checkpoint_is_never_restored(data, tmp_path):
    model = mlp()
    fit(model, data, epochs=1, checkpoint_dir=tmp_path)
    # What a writer killed mid-save leaves: orbax writes into a temporary
    # directory and renames it into place only when it is complete.
    partial = tmp_path / "1.orbax-checkpoint-tmp-1700000000"
    (partial / "default").mkdir(parents=True)
    (partial / "default" / "garbage").write_bytes(b"\0" * 100)
    resumed = mlp(seed=7)
    assert fit(resumed, data, epochs=1, checkpoint_dir=tmp_path).epoch == []
    assert_weights_equal(resumed, model)


def test_an_empty_newest_step_is_skipped_with_a_warning_that_says_so(tmp_path):
    # Before, the warning quoted orbax: "Unable to retrieve default item.
    # Please ensure that a handler for the default item is registered ...".
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(24, 4)).astype("float32"), rng.normal(size=(24, 2))
    fit_small = dict(batch_size=8, verbose=0, devices=devices(2), checkpoint_dir=tmp_path)
    one_epoch = small(8, "sgd")
    keras_dp.fit_sharded(one_epoch, x, y, **fit_small)
    (tmp_path / "1").mkdir()  # a step directory with nothing in it
    resumed = small(8, "sgd")
    with pytest.warns(RuntimeWarning, match=(
            r"skipped damaged checkpoints \(\S+/1: it holds no saved state \(a save cut "
            r"short, or a copy of one: delete it\)\); resuming from the older intact one, 0")):
        assert keras_dp.fit_sharded(resumed, x, y, **fit_small).epoch == []
    assert_weights_equal(resumed, one_epoch)


def test_a_checkpoint_of_another_model_or_seed_is_refused(data, tmp_path):
    fit(mlp(), data, epochs=1, checkpoint_dir=tmp_path)
    with pytest.raises(ValueError, match="seed=0"):
        fit(mlp(), data, epochs=2, checkpoint_dir=tmp_path, seed=1)
    other = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Flatten(),
                              keras.layers.Dense(10)])
    other.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match="does not fit this model"):
        fit(other, data, epochs=2, checkpoint_dir=tmp_path)


def small(width, optimizer):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(width, activation="relu"),
                              keras.layers.Dense(2)])
    model.compile(optimizer, "mse")
    return model


def test_a_checkpoint_of_other_widths_or_another_optimizer_names_what_differs(tmp_path):
    # Before, the message named neither the arrays nor their shapes.
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(24, 4)).astype("float32"), rng.normal(size=(24, 2))
    fit_small = dict(batch_size=8, verbose=0, devices=devices(3), checkpoint_dir=tmp_path)
    keras_dp.fit_sharded(small(8, "sgd"), x, y, **fit_small)
    wider = small(16, "sgd")
    with pytest.raises(ValueError, match=re.escape(
            "names or shapes differ (['state']['trainable']: 4 arrays in the checkpoint, 4 "
            "for this model; the first that differs, ['state']['trainable'][0], is (4, 8) "
            "float32 there and (4, 16) float32 here). Resume with the same model")):
        keras_dp.fit_sharded(wider, x, y, epochs=2, **fit_small)
    with pytest.raises(ValueError, match=re.escape(
            "(['state']['optimizer']: 2 arrays in the checkpoint, 10 for this model; the "
            "first that differs, ['state']['optimizer'][2], is absent there and (4, 8) "
            "float32 here)")) as raised:
        keras_dp.fit_sharded(small(8, "adam"), x, y, epochs=2, **fit_small)
    assert f"The checkpoint in {tmp_path}/0 does not fit this model" in str(raised.value)
    assert int(wider.optimizer.iterations.numpy()) == 0  # nothing restored, nothing trained


def test_a_checkpoint_of_another_optimizer_with_the_same_shapes_is_refused(tmp_path):
    # SGD's momentum and RMSprop's velocity have the same shapes: before,
    # RMSprop restored SGD's momentum (negative entries) as its mean squares
    # and the first step stopped on a NaN update, a FloatingPointError.
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(24, 4)).astype("float32"), rng.normal(size=(24, 2))
    fit_small = dict(batch_size=8, verbose=0, devices=devices(2), checkpoint_dir=tmp_path)
    keras_dp.fit_sharded(small(8, keras.optimizers.SGD(0.1, momentum=0.9)), x, y, **fit_small)
    model = small(8, keras.optimizers.RMSprop(0.01))
    with pytest.raises(ValueError, match=(
            r"^The checkpoint in \S+ was written with the optimizer SGD, and this model's "
            r"is RMSprop: .* Compile with SGD to resume that run, or pass a new "
            r"checkpoint_dir")):
        keras_dp.fit_sharded(model, x, y, epochs=2, **fit_small)
    resumed = small(8, keras.optimizers.SGD(0.1, momentum=0.9))  # the same optimizer resumes
    assert keras_dp.fit_sharded(resumed, x, y, epochs=2, **fit_small).epoch == [1]


def two_checkpoints(data, directory):
    """Checkpoints 0 (after epoch 1) and 1 (after epoch 2); the model after epoch 2."""
    model = mlp()
    fit(model, data, epochs=1, checkpoint_dir=directory)
    fit(model, data, epochs=2, checkpoint_dir=directory)
    assert sorted(os.listdir(directory)) == [".keras_dp.lock", "0", "1"]
    return model


def largest_data_file(checkpoint):
    files = [path for path in checkpoint.rglob("*") if path.is_file()]
    return max(files, key=lambda path: path.stat().st_size)


def flip_bytes(path, count=64):
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for i in range(middle, middle + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path):
    with open(path, "r+b") as file:
        file.truncate(path.stat().st_size // 2)


@pytest.mark.parametrize("damage", [flip_bytes, truncate])
def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning(data, tmp_path, damage):
    two_epochs = two_checkpoints(data, tmp_path)
    damage(largest_data_file(tmp_path / "1"))
    resumed = mlp(seed=7)
    with pytest.warns(RuntimeWarning, match=r"skipped damaged checkpoints \(\S*/1: (its data could "
                      r"not be read|1 arrays differ from the checksums).*"
                      r"resuming from the older intact one, 0"):
        history = fit(resumed, data, epochs=2, checkpoint_dir=tmp_path)
    # Resumed from checkpoint 0 (after epoch 1) and trained epoch 2 again:
    # bitwise the weights of the run that wrote checkpoint 1.
    assert history.epoch == [1]
    assert_weights_equal(resumed, two_epochs)


def test_a_directory_of_damaged_checkpoints_is_refused(data, tmp_path):
    fit(mlp(), data, epochs=1, checkpoint_dir=tmp_path)
    flip_bytes(largest_data_file(tmp_path / "0"))
    with pytest.raises(checkpoint_lib.DamagedCheckpointError,
                       # Flipped bytes in compressed data fail the read itself;
                       # elsewhere, the checksum: either way, damaged.
                       match=r"Every checkpoint in .* is damaged.*0: (1 arrays differ from "
                             r"the checksums written with them \(\['state'\]|its data "
                             r"could not be read)"):
        fit(mlp(), data, epochs=2, checkpoint_dir=tmp_path)


def model_state(model):
    """The model's state as an older keras_dp saved it: numpy arrays from the model."""
    return {name: [np.asarray(variable.value) for variable in variables]
            for name, variables in keras_dp.TrainState.variables_of(model).groups()}


@pytest.mark.parametrize("sums", [None, "crc32"])
def test_an_older_checkpoint_is_restored_checked_by_its_crc32s_or_unchecked(
        data, tmp_path, sums):
    import orbax.checkpoint as ocp

    from keras_dp.checkpoint import integrity as guard

    # What keras_dp wrote before these checksums: the state and the position,
    # then CRC-32s of each array's bytes.
    model = two_checkpoints(data, tmp_path / "new")
    tree = {"state": model_state(model), "position": checkpoint_lib._position_tree(2, 0, 0)}
    if sums == "crc32":
        tree[guard.LEGACY_SUMS] = guard.crc32s(tree)
        assert guard.crc32s(tree).dtype == np.int64 and len(tree["checksums"]) > 10
    manager = ocp.CheckpointManager(tmp_path / "old")
    manager.save(0, args=ocp.args.StandardSave(tree))
    manager.close()
    resumed = mlp(seed=7)
    if sums is None:
        with pytest.warns(RuntimeWarning, match=r"old/0 has no checksums .* restored unchecked"):
            assert fit(resumed, data, epochs=2, checkpoint_dir=tmp_path / "old").epoch == []
    else:
        assert fit(resumed, data, epochs=2, checkpoint_dir=tmp_path / "old").epoch == []
    assert_weights_equal(resumed, model)
    if sums == "crc32":  # and a damaged one is found by its CRC-32s
        flip_bytes(largest_data_file(tmp_path / "old" / "0"))
        with pytest.raises(checkpoint_lib.DamagedCheckpointError,
                           match=r"0: (1 arrays differ|its data could not be read)"):
            fit(mlp(), data, epochs=2, checkpoint_dir=tmp_path / "old")


HOLD_THE_LOCK = """
import sys, time
from keras_dp.checkpoint.integrity import DirectoryLock
lock = DirectoryLock(sys.argv[1])
print("locked", flush=True)
time.sleep(300)
"""


def test_a_directory_in_use_by_a_live_run_is_refused_and_a_dead_runs_lock_taken_over(
        data, tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD_THE_LOCK, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        assert holder.stdout.readline().strip() == "locked"
        model = mlp()
        with pytest.raises(checkpoint_lib.DirectoryInUseError,
                           match=rf"in use by another run \(pid {holder.pid} on "):
            fit(model, data, epochs=1, checkpoint_dir=tmp_path)
        assert os.listdir(tmp_path) == [".keras_dp.lock"]  # nothing written
        assert int(model.optimizer.iterations.numpy()) == 0  # no step taken
    finally:
        holder.kill()  # SIGKILL: the lock file stays behind, the lock goes
        holder.wait()
    # A fit that fails before its first step (bad labels) lets go of the directory too.
    x, y = data
    with pytest.raises(ValueError, match="label"):
        fit(mlp(), (x, np.where(np.arange(len(y)) == 9, 10, y)), epochs=1, checkpoint_dir=tmp_path)
    fit(mlp(), data, epochs=1, checkpoint_dir=tmp_path)
    assert sorted(os.listdir(tmp_path)) == [".keras_dp.lock", "0"]


def test_a_checkpoint_dir_under_home_with_a_space_is_expanded_not_made_literally(
        data, tmp_path, monkeypatch):
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    model = mlp()
    fit(model, data, epochs=1, checkpoint_dir="~/my runs/ckpt")
    assert sorted(os.listdir(home / "my runs" / "ckpt")) == [".keras_dp.lock", "0"]
    assert os.listdir(work) == []  # no directory named "~" here
    resumed = mlp(seed=7)
    assert fit(resumed, data, epochs=1, checkpoint_dir="~/my runs/ckpt").epoch == []
    assert_weights_equal(resumed, model)


def test_checkpoints_to_keep_sets_how_many_stay(data, tmp_path):
    fit(mlp(), data, epochs=2, checkpoint_dir=tmp_path / "one", checkpoints_to_keep=1)
    assert sorted(os.listdir(tmp_path / "one")) == [".keras_dp.lock", "1"]
    fit(mlp(), data, checkpoint_dir=tmp_path / "three", checkpoints_to_keep=3)
    assert sorted(os.listdir(tmp_path / "three")) == [".keras_dp.lock", "0", "1", "2"]
    with pytest.raises(ValueError, match=r"^`checkpoints_to_keep` must be at least 1\. "
                                         r"Received: checkpoints_to_keep=0\.$"):
        fit(mlp(), data, checkpoint_dir=tmp_path / "none", checkpoints_to_keep=0)
    assert not (tmp_path / "none").exists()


def test_a_checkpoint_dir_that_is_a_file_is_named_before_the_first_step(data, tmp_path):
    path = tmp_path / "weights.txt"
    path.write_text("not a directory")
    model = mlp()
    with pytest.raises(FileExistsError, match=r"checkpoint_dir .*weights.txt cannot be used "
                                              r"\(File exists\): it must be a directory") as raised:
        fit(model, data, epochs=1, checkpoint_dir=path)
    assert raised.value.__cause__ is None and raised.value.__suppress_context__
    assert int(model.optimizer.iterations.numpy()) == 0  # no step taken
    assert path.read_text() == "not a directory"


def full_disk(tmp_path, mib, case):
    """Run `scripts/full_disk.py` on a real tmpfs of `mib` MiB in a private mount namespace."""
    mount = tmp_path / "mnt"
    mount.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    command = ["unshare", "-rm", sys.executable, str(ROOT / "tests" / "scripts" / "full_disk.py"),
               str(mount), "--mib", str(mib), "--case", case]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    if done.returncode != 0 and "unshare" in done.stderr and "Operation not permitted" in done.stderr:
        pytest.skip("no user namespaces here: a tmpfs cannot be mounted without root")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]  # one error, no orbax noise
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # 7 s: moved out of CI to keep the default run under 10 minutes
def test_a_full_disk_is_refused_before_the_first_step(tmp_path):
    # 0.25 MiB free; the run needs 3 checkpoints of 0.08 MiB plus metadata.
    result = full_disk(tmp_path, 0.25, "small")
    assert result["error"].startswith(
        "OSError: [Errno 28] Not enough free space for checkpoints in ")
    assert "0.25 MiB free, and this fit needs 0.43 MiB (3 more checkpoints of 0.08 MiB" \
        in result["error"]
    assert result["steps"] == 0 and result["weights_equal_reference"]  # untouched
    assert result["files"] == [".keras_dp.lock"]


@pytest.mark.slow
def test_a_save_onto_a_full_disk_is_one_clear_error_and_keeps_the_weights(tmp_path):
    # The check passes (1 MiB free); a callback then fills the disk before epoch 1's save.
    result = full_disk(tmp_path, 1, "fill")
    assert result["error"] == (
        f"OSError: [Errno 28] Saving the checkpoint of the end of epoch 1 in "
        f"{tmp_path / 'mnt'} failed (OSError: [Errno 28] No space left on device). "
        "The model holds the weights it trained; the newest complete checkpoint "
        "there is unchanged. Free space or fix the directory, then rerun the same "
        "fit to resume.")
    # Bitwise the weights of the same epoch trained without a checkpoint_dir.
    assert result["steps"] == 8 and result["weights_equal_reference"]


def poisoned(data, batch):
    x, y = data
    x = x.copy()
    x[batch * BATCH + 3] = np.nan
    return x, y


@pytest.mark.parametrize("steps_per_execution", [1, 3])
def test_a_nan_loss_names_the_step_and_keeps_the_last_good_weights(data, steps_per_execution):
    five_steps = mlp()
    fit(five_steps, (data[0][: 5 * BATCH], data[1][: 5 * BATCH]), epochs=1, shuffle=False)
    model = mlp()
    with pytest.raises(FloatingPointError, match=r"nan at epoch 2, batch 5 \(counted"):
        fit(model, poisoned(data, 5), shuffle=False, steps_per_execution=steps_per_execution,
            initial_epoch=1)
    for left, right in zip(weights(model), weights(five_steps), strict=True):
        assert_close_to_scale(left, right)
        assert np.isfinite(left).all()


def test_terminate_on_nan_stops_without_an_error(data):
    five_steps = mlp()
    fit(five_steps, (data[0][: 5 * BATCH], data[1][: 5 * BATCH]), epochs=1, shuffle=False)
    model = mlp()
    history = fit(model, poisoned(data, 5), shuffle=False,
                  callbacks=[keras.callbacks.TerminateOnNaN()])
    assert history.epoch == [0] and np.isnan(history.history["loss"][0])
    assert_weights_equal(model, five_steps)


def test_a_save_never_asks_jax_for_the_preemption_sync_point(data, tmp_path, monkeypatch):
    # JAX's sync point is reached by one call only; keras_dp's SyncedPreemption
    # must be the only caller, or a preempted multi-process run may miss it.
    from jax.experimental import multihost_utils

    asked = []
    monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point",
                        lambda step: asked.append(step) or False)
    fit(mlp(), data, epochs=2, checkpoint_dir=tmp_path)
    assert sorted(int(name) for name in os.listdir(tmp_path) if name.isdigit()) == [0, 1]
    assert asked == []


def permissions_enforced(tmp_path):
    probe = tmp_path / "probe"
    probe.mkdir(mode=0o500)
    try:
        (probe / "file").touch()
    except PermissionError:
        return True
    return False  # root (CAP_DAC_OVERRIDE) writes anyway


def test_a_checkpoint_dir_made_read_only_is_refused_before_the_first_step(tmp_path):
    # Before, its lock file still opened, an epoch trained, and its save
    # failed; a directory that cannot be created was refused at once.
    if not permissions_enforced(tmp_path):
        pytest.skip("this user writes into a directory of mode 0o500 (root)")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(24, 4)).astype("float32"), rng.normal(size=(24, 2))
    fit_small = dict(batch_size=8, verbose=0, devices=devices(2), checkpoint_dir=tmp_path / "c")
    keras_dp.fit_sharded(small(8, "sgd"), x, y, **fit_small)
    os.chmod(tmp_path / "c", 0o500)
    model = small(8, "sgd")
    try:
        with pytest.raises(PermissionError, match=(
                r"^\[Errno 13\] checkpoint_dir \S+/c cannot be written to \(Permission denied\): "
                r"the first save.*fix its permissions \(chmod u\+w\), or pass another path\.$")):
            keras_dp.fit_sharded(model, x, y, epochs=2, **fit_small)
    finally:
        os.chmod(tmp_path / "c", 0o700)
    assert int(model.optimizer.iterations.numpy()) == 0  # not a step trained
    assert keras_dp.fit_sharded(model, x, y, epochs=2, **fit_small).epoch == [1]  # writable: resumes


def dense_first():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, use_bias=False),
                              keras.layers.Dense(8)])
    model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def embedding_first():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1,), dtype="int32"), keras.layers.Embedding(8, 8),
                              keras.layers.Flatten(), keras.layers.Dense(8)])
    model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_a_checkpoint_of_the_same_shapes_in_other_layers_is_refused_naming_the_first(tmp_path):
    # Both hold (8, 8), (8, 8) and (8,) arrays: before, the Dense kernel was
    # restored as the Embedding's table and the run went on silently.
    x = np.random.default_rng(0).normal(size=(24, 8)).astype("float32")
    tokens, y = (np.arange(24) % 8)[:, None], np.arange(24) % 8
    fit_small = dict(batch_size=8, verbose=0, devices=devices(2), checkpoint_dir=tmp_path)
    keras_dp.fit_sharded(dense_first(), x, y, **fit_small)
    other = embedding_first()
    with pytest.raises(ValueError, match=re.escape(
            f"The checkpoint in {tmp_path} was written for another model: its arrays fit "
            "this model's shapes, but weight 0 (trainable weights first, as layer class/name, "
            "shape, dtype) is Dense/kernel (8, 8) float32 there and Embedding/embeddings "
            "(8, 8) float32 here, so the arrays would be restored")):
        keras_dp.fit_sharded(other, tokens, y, epochs=2, **fit_small)
    assert int(other.optimizer.iterations.numpy()) == 0  # nothing restored, nothing trained
    # Layers named anew (dense_5 where the run had dense_1, as in another
    # Python process) are the same model: it resumes.
    assert [dense_first() for _ in range(2)][-1].layers[0].name != "dense"
    assert keras_dp.fit_sharded(dense_first(), x, y, epochs=2, **fit_small).epoch == [1]


def test_variable_signatures_name_each_weights_layer_class_not_its_path():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dropout(0.5),
                              keras.layers.BatchNormalization()])
    from keras_dp.checkpoint import integrity as checkpoint_guard

    assert checkpoint_guard.variable_signatures(model) == [
        "Dense/kernel (4, 3) float32", "Dense/bias (3,) float32",
        "BatchNormalization/gamma (3,) float32", "BatchNormalization/beta (3,) float32",
        "Dropout/seed_generator_state (2,) uint32",
        "BatchNormalization/moving_mean (3,) float32",
        "BatchNormalization/moving_variance (3,) float32"]


class SetsLearningRate(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.model.optimizer.learning_rate.assign(0.5)


def test_a_resume_restores_the_checkpoints_learning_rate_unless_a_callback_sets_one(tmp_path):
    # Hyperparameters are not compared (a new one is a choice), but the
    # learning rate is an optimizer variable: the checkpoint's comes back.
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(24, 4)).astype("float32"), rng.normal(size=(24, 2))
    fit_small = dict(batch_size=8, verbose=0, devices=devices(2), checkpoint_dir=tmp_path)
    keras_dp.fit_sharded(small(8, keras.optimizers.SGD(0.1)), x, y, **fit_small)
    resumed = small(8, keras.optimizers.SGD(0.5))
    assert keras_dp.fit_sharded(resumed, x, y, epochs=2, **fit_small).epoch == [1]
    assert float(resumed.optimizer.learning_rate.numpy()) == np.float32(0.1)
    changed = small(8, keras.optimizers.SGD(0.5))
    keras_dp.fit_sharded(changed, x, y, epochs=3, callbacks=[SetsLearningRate()], **fit_small)
    assert float(changed.optimizer.learning_rate.numpy()) == 0.5


@pytest.mark.parametrize("change", [
    dict(steps_per_execution=3, data_on_device=False), dict(devices=devices(4))],
    ids=["k_and_feed", "devices"])
def test_a_mid_epoch_checkpoint_resumes_under_another_k_feed_or_device_count(
        data, tmp_path, change):
    # README: another steps_per_execution or data_on_device keeps every
    # step's rows and resumes bitwise; another device count sums the
    # gradients in another order, so it resumes to rounding.
    unbroken = mlp(dropout=0.25)
    fit(unbroken, data, epochs=2)
    with pytest.raises(SystemExit):
        fit(mlp(dropout=0.25), data, epochs=2, checkpoint_dir=tmp_path,
            callbacks=[SigtermAt(1, 4)])
    resumed = mlp(seed=7, dropout=0.25)
    assert fit(resumed, data, epochs=2, checkpoint_dir=tmp_path, **change).epoch == [1]
    assert int(resumed.optimizer.iterations.numpy()) == 2 * ROWS // BATCH
    if "devices" not in change:
        assert_weights_equal(resumed, unbroken)
        return
    for mine, reference in zip(weights(resumed), weights(unbroken), strict=True):
        assert_close_to_scale(mine, reference)


@pytest.mark.slow  # 6 s on the 2-core VM
def test_a_disk_full_mid_save_at_epoch_2_keeps_epoch_1s_checkpoint_and_a_rerun_resumes_it(
        tmp_path, monkeypatch, caplog):
    # orbax writes the arrays (tensorstore), then its metadata from Python;
    # ENOSPC at the metadata of epoch 2's checkpoint, of 3 epochs, leaves a
    # half-written temporary directory beside epoch 1's checkpoint. Before,
    # orbax logged that error's whole traceback from its writer thread above
    # keras_dp's one-line OSError; now the OSError alone says it.
    from etils import epath

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(30, 6)).astype("float32"), rng.integers(0, 4, 30)
    options = dict(batch_size=8, epochs=3, verbose=0, devices=devices(3))

    def model():
        keras.utils.set_random_seed(0)
        made = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                                 keras.layers.Dropout(0.25), keras.layers.Dense(4)])
        made.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True))
        return made

    class AfterEpoch2(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                kept.extend(weights(self.model))  # self.model: synced with the devices

    unbroken, kept = model(), []
    keras_dp.fit_sharded(unbroken, x, y, callbacks=[AfterEpoch2()], **options)
    path_class, write_text = type(epath.Path(tmp_path)), epath.Path.write_text

    def full_disk(path, *args, **kwargs):
        if path.name == "_METADATA" and "1.orbax-checkpoint-tmp" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return write_text(path, *args, **kwargs)

    monkeypatch.setattr(path_class, "write_text", full_disk)
    broken = model()
    caplog.clear()
    with pytest.raises(OSError) as raised:
        keras_dp.fit_sharded(broken, x, y, checkpoint_dir=tmp_path, **options)
    assert raised.value.errno == errno.ENOSPC and raised.value.__cause__ is None
    assert str(raised.value).startswith(
        f"[Errno 28] Saving the checkpoint of the end of epoch 2 in {tmp_path} failed "
        "(OSError: [Errno 28] No space left on device: ")
    assert [record.getMessage()[:80] for record in caplog.records
            if record.levelno >= logging.ERROR] == []
    for mine, epoch_2 in zip(weights(broken), kept, strict=True):  # every step it took
        np.testing.assert_array_equal(mine, epoch_2)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == [".keras_dp.lock", "0", "1.orbax-checkpoint-tmp"]
    resumed = model()
    assert keras_dp.fit_sharded(resumed, x, y, checkpoint_dir=tmp_path, **options).epoch == [1, 2]
    assert_weights_equal(resumed, unbroken)
    assert sorted(os.listdir(tmp_path)) == [".keras_dp.lock", "1", "2"]


def test_sigterm_ends_the_process_again_after_a_fit_whose_handler_before_was_not_pythons(
        monkeypatch):
    # `signal.signal` returns None when the handler it replaces was set
    # outside Python. The watcher then left its own handler installed after
    # the fit: a later SIGTERM was recorded on it and never acted on.
    from keras_dp.checkpoint import preemption

    real = signal.signal
    calls = []

    def replaced_from_c(signum, handler):
        previous = real(signum, handler)
        calls.append(handler)
        return None if len(calls) == 1 else previous

    monkeypatch.setattr(preemption.signal, "signal", replaced_from_c)
    before = signal.getsignal(signal.SIGTERM)
    try:
        with preemption.Preemption() as watcher:
            assert signal.getsignal(signal.SIGTERM) == watcher._handle
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        real(signal.SIGTERM, before)


def test_the_sigterm_message_says_where_the_run_stopped_in_words(capsys):
    # At an epoch's end it said "after 0 steps of epoch 3" for the end of epoch 2.
    from keras_dp.checkpoint import preemption

    for position, where in ((checkpoint_lib.Position(2, 0), "at the end of epoch 2"),
                            (checkpoint_lib.Position(2, 5), "after 5 steps of epoch 3")):
        with pytest.raises(SystemExit) as ended:
            preemption.exit_after_preemption("/ckpt", position)
        assert ended.value.code == 143
        assert capsys.readouterr().err == (
            f"keras_dp: SIGTERM received; saved a checkpoint in /ckpt {where}. Run the "
            "same fit with the same checkpoint_dir to resume from there.\n")


def test_a_save_that_fails_for_another_reason_than_the_disk_says_so(data, tmp_path, monkeypatch):
    # Every failure of a save was an OSError telling to free space: an error
    # of orbax's own (a tree it cannot write) sent the user to the disk.
    import orbax.checkpoint as ocp

    def fails(self, *args, **kwargs):
        raise ValueError("Unsupported type in the tree")

    monkeypatch.setattr(ocp.CheckpointManager, "save", fails)
    model = mlp()
    with pytest.raises(RuntimeError) as raised:
        fit(model, (data[0][:64], data[1][:64]), epochs=1, checkpoint_dir=tmp_path)
    assert str(raised.value) == (
        f"Saving the checkpoint of the end of epoch 1 in {tmp_path} failed (ValueError: "
        "Unsupported type in the tree). The model holds the weights it trained; the "
        "newest complete checkpoint there is unchanged. If the disk or the directory "
        "is at fault, fix it and rerun the same fit to resume.")
    assert isinstance(raised.value.__cause__, ValueError)


def test_the_preemption_sync_step_ids_keep_growing_across_fits(monkeypatch):
    # Each fit counted JAX's sync-point step ids from 0: after a SIGTERM
    # between two fits, JAX's sync point (one past the last id it was
    # given) could lie beyond a shorter next fit, which then never saw it.
    from jax.experimental import multihost_utils

    from keras_dp.multihost import hosts as preemption

    given = []
    monkeypatch.setattr(preemption, "_preemption_service_enabled", lambda: True)
    monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point",
                        lambda step: given.append(step) or False)
    for _ in range(2):  # two fits, three reads each
        with preemption.SyncedPreemption() as watcher:
            assert [watcher.requested for _ in range(3)] == [False] * 3
    assert given == sorted(given) and len(set(given)) == 6


def test_a_manager_that_fails_to_open_leaves_the_directory_unlocked(tmp_path, monkeypatch):
    # The lock was taken, then orbax's manager raised, and the lock stayed:
    # the next fit on the directory in this process was refused as a run
    # that holds it (naming this process).
    import orbax.checkpoint as ocp

    real = ocp.CheckpointManager.__init__

    def fails(self, *args, **kwargs):
        raise OSError("the filesystem went away")

    monkeypatch.setattr(ocp.CheckpointManager, "__init__", fails)
    with pytest.raises(OSError, match="the filesystem went away"):
        checkpoint_lib.Checkpoints(tmp_path)
    monkeypatch.setattr(ocp.CheckpointManager, "__init__", real)
    checkpoint_lib.Checkpoints(tmp_path).close()  # not DirectoryInUseError
