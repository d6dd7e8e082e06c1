"""Grain as a source: training, one pass per epoch, its position in checkpoints, per-process shares."""

import pathlib
import sys

import numpy as np
import pytest

grain = pytest.importorskip("grain")

import keras_dp  # noqa: E402
from keras_dp import sources as pipeline  # noqa: E402
from keras_dp.core.live import Position  # noqa: E402
from keras_dp.sources import grain as grain_source  # noqa: E402
from conftest import assert_weights_equal  # noqa: E402
from conftest import devices  # noqa: E402
from conftest import mlp  # noqa: E402
from conftest import sigterm_stops  # noqa: E402
from test_checkpoint import SigtermAt  # noqa: E402

ROWS, BATCH = 512, 64  # 8 steps per epoch


class Rows:
    """A Grain data source over (x, y) rows that counts the rows read."""

    def __init__(self, x, y):
        self.x, self.y, self.read = x, y, []

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        self.read.append(int(index))
        return self.x[index], self.y[index]


@pytest.fixture
def data(mnist):
    (x, y), _ = mnist
    return x[:ROWS].astype("float32"), y[:ROWS]


def batched(source, shuffle_seed=None):
    """Batches of `BATCH` rows, read in this thread one at a time (no read-ahead)."""
    dataset = grain.MapDataset.source(source)
    if shuffle_seed is not None:
        dataset = dataset.shuffle(seed=shuffle_seed)
    options = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
    return dataset.batch(BATCH).to_iter_dataset(options)


def fit(model, x, **kwargs):
    kwargs = dict(dict(epochs=3, verbose=0, devices=devices(2)), **kwargs)
    return keras_dp.fit_sharded(model, x, **kwargs)


def test_a_map_dataset_trains_bitwise_as_the_same_batches_as_arrays(data):
    # The same batches in the same order run the same compiled steps.
    grain_model, array_model = mlp(dropout=0.25), mlp(dropout=0.25)
    dataset = grain.MapDataset.source(Rows(*data)).batch(BATCH)
    history = fit(grain_model, dataset, validation_data=dataset)
    fit(array_model, data[0], y=data[1], batch_size=BATCH, shuffle=False,
        validation_data=data)
    assert_weights_equal(grain_model, array_model)
    assert int(grain_model.optimizer.iterations.numpy()) == 3 * ROWS // BATCH
    assert len(history.history["val_loss"]) == 3


def test_every_element_once_per_epoch_and_a_fresh_pass_each_epoch(data):
    ids = np.arange(ROWS, dtype=np.float32)
    source = grain.MapDataset.source(ids).shuffle(seed=5).batch(48)  # 10 full, 1 of 32
    batches = pipeline.make_batches(source)
    epochs = [np.concatenate([x for x, _, _ in batches.epoch(epoch)]) for epoch in range(2)]
    for seen in epochs:
        np.testing.assert_array_equal(np.sort(seen), ids)  # 512 ids, each once
    np.testing.assert_array_equal(epochs[0], epochs[1])  # Keras's semantics: iter() anew


def test_a_dataloader_position_is_saved_and_restored_per_epoch(data):
    source = Rows(*data)
    sampler = grain.samplers.IndexSampler(
        ROWS, shard_options=grain.sharding.NoSharding(), shuffle=True, seed=3, num_epochs=1)
    loader = grain.DataLoader(data_source=source, sampler=sampler,
                              operations=[grain.transforms.Batch(BATCH)], worker_count=0,
                              read_options=grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    batches = pipeline.make_batches(loader)
    epochs = batches.resumable
    epochs.recording = True
    whole = [y for _, y, _ in batches.epoch(0)]
    saved = epochs.saved(Position(0, 3))  # after batch 2 of epoch 0
    assert saved.shape == (1, grain_source.STATE_BYTES) and saved.dtype == np.uint8
    assert epochs.saved(Position(1, 0)).max() == 0  # an epoch's end: nothing to keep
    epochs.restore(Position(0, 3), saved)
    del source.read[:]
    rest = [y for _, y, _ in batches.epoch(0, 3)]
    assert len(source.read) == ROWS - 3 * BATCH  # batches 0-2 are not read again
    np.testing.assert_array_equal(epochs.saved(Position(0, 3)), saved)  # stopped again there
    np.testing.assert_array_equal(np.concatenate(rest), np.concatenate(whole[3:]))


def test_sigterm_mid_epoch_resumes_bitwise_from_the_same_element(data, tmp_path):
    source = Rows(*data)
    unbroken = mlp(dropout=0.25)
    unbroken_history = fit(unbroken, batched(source, shuffle_seed=7))
    order = source.read[BATCH:BATCH + ROWS]  # epoch 0's rows (after the first batch, peeked)
    model = mlp(dropout=0.25)
    with pytest.raises(SystemExit) as exit_info:
        fit(model, batched(Rows(*data), shuffle_seed=7), checkpoint_dir=tmp_path,
            callbacks=[SigtermAt(1, 4)])
    assert exit_info.value.code == 143
    # Saved after 5 steps of epoch 1; the resumed run reads its first batch
    # (to build the model), then epoch 1 from row 5 * BATCH of the order.
    resumed_source = Rows(*data)
    resumed = mlp(seed=7, dropout=0.25)
    history = fit(resumed, batched(resumed_source, shuffle_seed=7), checkpoint_dir=tmp_path)
    assert history.epoch == [1, 2]
    assert_weights_equal(resumed, unbroken)
    np.testing.assert_array_equal(history.history["loss"], unbroken_history.history["loss"][1:])
    assert resumed_source.read[BATCH:BATCH + 3 * BATCH] == order[5 * BATCH:]
    assert len(resumed_source.read) == BATCH + 3 * BATCH + ROWS


def test_shard_for_processes_gives_each_process_its_share(monkeypatch):
    tf = pytest.importorskip("tensorflow")
    dataset = grain.MapDataset.source(np.arange(10))
    assert keras_dp.shard_for_processes(dataset) is dataset  # one process: as it is
    monkeypatch.setattr("jax.process_count", lambda: 3)
    monkeypatch.setattr("jax.process_index", lambda: 1)
    assert [int(value) for value in keras_dp.shard_for_processes(dataset)] == [1, 4, 7]
    shard = keras_dp.shard_for_processes(tf.data.Dataset.range(10))
    assert list(shard.as_numpy_iterator()) == [1, 4, 7]
    with pytest.raises(TypeError, match="ShardByJaxProcess"):
        keras_dp.shard_for_processes(dataset.to_iter_dataset())
    with pytest.raises(TypeError, match="Received: ndarray. For arrays, .*process_share\\(x, y\\)"):
        keras_dp.shard_for_processes(np.arange(10))


def test_an_oversized_iterator_state_is_refused_with_the_limit():
    with pytest.raises(ValueError, match="16384"):
        grain_source._encode({"big": "x" * grain_source.STATE_BYTES})


# -- Across processes ---------------------------------------------------------

WORKER = pathlib.Path(__file__).parent / "scripts" / "grain_worker.py"


def run_processes(out, *extra):
    """2 processes of 2 simulated devices on loopback; their exit codes, logs and results."""
    from test_distributed import run_pair

    out.mkdir(parents=True)
    codes, logs = run_pair(out, command=[sys.executable, str(WORKER), "--out", str(out), *extra])
    results = [np.load(out / f"process{index}.npz") if code == 0 else None
               for index, code in enumerate(codes)]
    return codes, logs, results


def arrays(result):
    return [result[name] for name in result.files if name.startswith("arr_")]


@pytest.mark.slow  # about 2 minutes on the shared 2-core VM: 3 runs of 2 processes
def test_two_processes_read_their_shares_and_resume_mid_epoch_bitwise(tmp_path):
    # 798 rows, process p reads rows p, p + 2, ...: 399 each, 13 batches of
    # 32 per epoch (the last of 15).
    codes, logs, (first, second) = run_processes(tmp_path / "unbroken")
    assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    for mine, other in zip(arrays(first), arrays(second), strict=True):
        np.testing.assert_array_equal(mine, other)
    np.testing.assert_array_equal(first["counts"], np.ones(798))  # each row once, last epoch
    assert set(first["read"]) == set(range(0, 798, 2))
    assert set(second["read"]) == set(range(1, 798, 2))
    checkpoints = str(tmp_path / "checkpoints")
    # SIGTERM after epoch 2's first call (4 steps): JAX's runtime notices it
    # and every process stops at the same later call, mid-epoch (epoch 2's
    # calls end at steps 4, 8, 12 and 13; the worker sleeps 4 s a call once it
    # has sent the signal). Sent after step 5, or with 1.2 s a call on a
    # loaded machine, the stop came only at the epoch's end, where nothing
    # mid-epoch is resumed.
    codes, logs, _ = run_processes(tmp_path / "stopped", "--checkpoint-dir", checkpoints,
                                   "--signal", "1:1:1")
    assert codes == [143, 143], logs[1][-3000:]
    stops = [sigterm_stops(log) for log in logs]
    assert len(stops[0]) == 1 and stops[0] == stops[1], stops
    (epoch, steps_done), = stops[0]
    assert epoch == 1 and 4 <= steps_done < 13, stops  # mid-epoch, after the signal
    codes, logs, resumed = run_processes(tmp_path / "resumed", "--checkpoint-dir", checkpoints)
    assert codes == [0, 0], logs[0][-3000:]
    for result in resumed:
        for mine, reference in zip(arrays(result), arrays(first), strict=True):
            np.testing.assert_array_equal(mine, reference)  # bitwise the unbroken run
        np.testing.assert_array_equal(result["counts"], np.ones(798))
        # Read: the first batch (to build the model), the rest of the
        # stopped epoch from its next row, then whole epochs.
        rest = max(0, 399 - 32 * steps_done)
        assert len(result["read"]) == 32 + rest + 399 * (2 - epoch), (steps_done, epoch)
    np.testing.assert_array_equal(resumed[1]["read"][32:32 + rest],  # epoch 2's rest
                                  second["read"][32 + 2 * 399 - rest:32 + 2 * 399])


def test_a_dataloader_with_workers_and_unparsed_flags_says_how_to_parse_them(data):
    from absl import flags

    if flags.FLAGS.is_parsed():
        pytest.skip("absl flags are parsed in this process")
    sampler = grain.samplers.IndexSampler(ROWS, shard_options=grain.sharding.NoSharding(),
                                          num_epochs=1)
    loader = grain.DataLoader(data_source=Rows(*data), sampler=sampler,
                              operations=[grain.transforms.Batch(BATCH)], worker_count=1)
    with pytest.raises(RuntimeError, match=r"mark_as_parsed\(\)") as error:
        pipeline.make_batches(loader).peek()
    assert error.value.__cause__ is None


def test_a_grain_checkpoint_resumed_with_arrays_is_refused_naming_the_input(data, tmp_path):
    from keras_dp.checkpoint import store as checkpoint_lib

    model = mlp()
    trainer = keras_dp.ShardedTrainer(model, devices=devices(2))
    trainer.build((data[0][:8], data[1][:8]))
    source = pipeline.make_batches(grain.MapDataset.source(Rows(*data)).batch(BATCH)).resumable
    with checkpoint_lib.closing(checkpoint_lib.Checkpoints(tmp_path, source=source)) as saved:
        saved.save(trainer.init_state(), Position(1, 0), seed=0)
    with pytest.raises(ValueError, match="does not fit this model.*another input"):
        checkpoint_lib.open_for_fit(tmp_path, model, 0, 0)  # arrays: no source


class TwoProcesses:
    """A Grain source's checkpoint side as 2 processes saved it: each row one process's state."""

    def __init__(self, state):
        self.state = state

    def template(self):
        return np.zeros((2, grain_source.STATE_BYTES), np.uint8)

    def saved(self, position):
        return np.stack([grain_source._encode(self.state)] * 2)


def test_a_grain_checkpoint_of_2_processes_resumes_on_1_at_an_epochs_end_only(data, tmp_path):
    from test_checkpoint import save_as_if_by

    # At an epoch's end no position is held: the next epoch is a fresh pass
    # on any number of processes (before, refused as "another input").
    save_as_if_by(tmp_path, 2, Position(1, 0), data, source=TwoProcesses(None))
    assert fit(mlp(), batched(Rows(*data)), epochs=2, checkpoint_dir=tmp_path).epoch == [1]
    # Mid-epoch each process's iterator state is its own share's.
    other = tmp_path / "mid-epoch"
    save_as_if_by(other, 2, Position(1, 3), data, source=TwoProcesses({"next_index": 96}))
    with pytest.raises(ValueError, match=(
            r"stopped after 3 steps of epoch 2, written by 2 processes of 2 devices each, "
            r".*and this fit runs on 1 process of 2 devices: each process's share of the "
            r"data and its Grain position would not be the one it left.* Resume on 2 "
            r"processes to finish that epoch")):
        fit(mlp(), batched(Rows(*data)), epochs=2, checkpoint_dir=other)


@pytest.mark.slow
def test_steps_per_epoch_over_a_repeated_dataset_resumes_bitwise_mid_stream(data, tmp_path):
    # `.shuffle().repeat()`: Grain reshuffles each repetition; epochs of 5
    # steps cut across its passes of 8 batches, so the stream's position,
    # not an epoch's, is what the checkpoint must hold.
    def stream(source):
        return grain.MapDataset.source(source).shuffle(seed=7).repeat().batch(BATCH) \
            .to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))

    unbroken = mlp(dropout=0.25)
    fit(unbroken, stream(Rows(*data)), steps_per_epoch=5)
    with pytest.raises(SystemExit):
        fit(mlp(dropout=0.25), stream(Rows(*data)), steps_per_epoch=5,
            checkpoint_dir=tmp_path, callbacks=[SigtermAt(1, 2)])
    source = Rows(*data)
    resumed = mlp(seed=7, dropout=0.25)
    assert fit(resumed, stream(source), steps_per_epoch=5,
               checkpoint_dir=tmp_path).epoch == [1, 2]
    assert_weights_equal(resumed, unbroken)
    assert len(source.read) == BATCH + (2 + 5) * BATCH  # the first batch, then 7 steps
    # Stopped at an epoch's end, the stream goes on from there too.
    fit(mlp(dropout=0.25), stream(Rows(*data)), steps_per_epoch=5, epochs=2,
        checkpoint_dir=tmp_path / "at_the_end")
    resumed = mlp(seed=7, dropout=0.25)
    assert fit(resumed, stream(Rows(*data)), steps_per_epoch=5,
               checkpoint_dir=tmp_path / "at_the_end").epoch == [2]
    assert_weights_equal(resumed, unbroken)


def test_a_stream_restored_at_an_epochs_end_continues_with_the_next_element():
    ids = np.arange(40, dtype=np.float32)
    stream = grain.MapDataset.source(ids).shuffle(seed=1).repeat().batch(8)  # 5 per pass

    def steps(position=None, saved=None):
        epochs = pipeline.StepsPerEpoch(pipeline.make_batches(stream), 3)  # across passes
        epochs.resumable.recording = True
        if position is not None:
            epochs.resumable.restore(position, saved)
        return epochs

    unbroken = steps()
    first = [x for x, _, _ in unbroken.epoch(0)]
    saved = unbroken.resumable.saved(Position(1, 0))
    second = [x for x, _, _ in unbroken.epoch(1)]
    resumed = steps(Position(1, 0), saved)
    rest = resumed.epoch(1, 0)
    np.testing.assert_array_equal(resumed.resumable.saved(Position(1, 0)), saved)
    np.testing.assert_array_equal(np.concatenate(list(x for x, _, _ in rest)),
                                  np.concatenate(second))
    assert len(first) == len(second) == 3
