"""The host pipeline (`keras_dp.sources`): user data to host batches, in order, every row once."""

import gc
import warnings

import keras
import numpy as np
import tensorflow as tf
import pytest

import keras_dp
from conftest import assert_weights_close, devices, mlp, sgd_mlp


def test_prefetch_keeps_order_raises_in_place_and_stops_when_closed():
    import threading
    import time

    from keras_dp.core.feed import prefetch

    assert list(prefetch(iter(range(50)), 2)) == list(range(50))
    assert list(prefetch(iter(range(5)), 0)) == list(range(5))

    def failing():
        yield 1
        raise ValueError("batch 1 is bad")

    seen = []
    with pytest.raises(ValueError, match="batch 1 is bad"):
        for item in prefetch(failing(), 2):
            seen.append(item)
    assert seen == [1]
    produced = []
    stream = prefetch((produced.append(i) or i for i in range(1000)), 2)
    assert next(stream) == 0
    stream.close()
    time.sleep(0.5)
    assert len(produced) <= 4  # the one taken, two queued, one waiting
    assert not any(t.name == "keras_dp-prefetch" for t in threading.enumerate())


@pytest.mark.parametrize("data", [[], "exhausted generator"])
def test_a_dataset_that_yields_nothing_is_refused(data):
    if data == "exhausted generator":
        data = (batch for batch in [])
    with pytest.raises(ValueError, match="yielded no batches: it is empty"):
        keras_dp.fit_sharded(mlp(), data, verbose=0, devices=devices(2))


def test_a_generator_read_for_several_epochs_is_refused_before_any_step(mnist):
    # A generator is used up by epoch 1. Refused once epoch 1 had trained,
    # before; model.fit trains epoch 2 on the generator's first 2 batches again.
    (x, y), _ = mnist
    batches = ((x[i:i + 64], y[i:i + 64]) for i in range(0, 128, 64))
    model = mlp()
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match=r"`x` is a one-shot iterator .* read it 2 times "
                       r"\(epochs=3, initial_epoch=1\).*`steps_per_epoch`"):
        keras_dp.fit_sharded(model, batches, epochs=3, initial_epoch=1, verbose=0,
                             devices=devices(2))
    for old, new in zip(before, model.get_weights(), strict=True):
        np.testing.assert_array_equal(old, new)
    assert int(model.optimizer.iterations.numpy()) == 0


def test_a_validation_generator_read_at_several_epochs_is_refused_at_once(mnist):
    # Before, epoch 2's validation raised "yielded no batches in epoch 0"
    # after training epoch 2. Read once (validation_freq), or with
    # validation_steps (read on from where it stopped), it is scored.
    (x, y), _ = mnist
    x, y = x[:128], y[:128]

    def batches():
        for i in range(0, 128, 64):
            yield x[i:i + 64], y[i:i + 64]

    with pytest.raises(ValueError, match=r"`validation_data` is a one-shot iterator .* read "
                       r"it 2 times \(epochs=2, validation_freq=1\).*`validation_steps`"):
        keras_dp.fit_sharded(mlp(), x, y, epochs=2, validation_data=batches(), verbose=0,
                             devices=devices(2))
    history = keras_dp.fit_sharded(sgd_mlp(), x, y, epochs=2, validation_freq=2, shuffle=False,
                                   validation_data=batches(), verbose=0, devices=devices(2))
    expected = sgd_mlp().fit(x, y, epochs=2, validation_freq=2, validation_data=(x, y),
                             shuffle=False, verbose=0)
    assert len(history.history["val_loss"]) == 1
    np.testing.assert_allclose(history.history["val_loss"], expected.history["val_loss"],
                               rtol=1e-5)
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-5)


def test_arrays_without_rows_are_refused():
    with pytest.raises(ValueError, match="has no rows"):
        keras_dp.fit_sharded(mlp(), np.zeros((0, 28, 28, 1)), np.zeros(0), verbose=0)


def test_x_and_y_of_different_lengths_are_refused(mnist):
    (x, y), _ = mnist
    with pytest.raises(ValueError, match=r"^The training data has arrays of different "
                       r"lengths, in rows \(first dimension\): x 64, y 63\."):
        keras_dp.fit_sharded(mlp(), x[:64], y[:63], batch_size=32, verbose=0)


def test_batch_size_with_a_dataset_is_refused(mnist):
    (x, y), _ = mnist
    with pytest.raises(ValueError, match="Do not pass `batch_size` with a dataset"):
        keras_dp.fit_sharded(mlp(), [(x[:64], y[:64])], batch_size=64, verbose=0)


def test_steps_per_epoch_reads_an_endless_dataset_and_stops_a_short_generator(mnist):
    (x, y), _ = mnist
    endless = tf.data.Dataset.from_tensor_slices((x[:256], y[:256])).batch(64).repeat()
    model = mlp()
    history = keras_dp.fit_sharded(model, endless, steps_per_epoch=5, epochs=2, verbose=0,
                                   devices=devices(2))
    assert int(model.optimizer.iterations.numpy()) == 10 and history.epoch == [0, 1]
    # Arrays of 4 batches a pass: epochs of 3 steps end where the pass ends, as in model.fit.
    model = mlp()
    with pytest.warns(UserWarning, match="ran out after 1 steps of epoch 2, before "
                      "steps_per_epoch=3: as under Keras's model.fit, the epoch ends there"):
        keras_dp.fit_sharded(model, x[:256], y[:256], batch_size=64, steps_per_epoch=3,
                             epochs=3, verbose=0, devices=devices(2))
    assert int(model.optimizer.iterations.numpy()) == 3 + 1 + 3
    short = ((x[i:i + 32], y[i:i + 32]) for i in range(0, 224, 32))  # 7 batches
    model = mlp()
    with pytest.warns(UserWarning, match="ran out of data in epoch 2.*steps_per_epoch \\* epochs"):
        history = keras_dp.fit_sharded(model, short, steps_per_epoch=5, epochs=3, verbose=0,
                                       devices=devices(2))
    assert int(model.optimizer.iterations.numpy()) == 7 and history.epoch == [0, 1]
    # A generator that ends with an epoch stops the fit there, without an empty epoch.
    exact = ((x[i:i + 32], y[i:i + 32]) for i in range(0, 320, 32))  # 10 batches
    model = mlp()
    with pytest.warns(UserWarning, match="ran out of data at the end of epoch 2"):
        history = keras_dp.fit_sharded(model, exact, steps_per_epoch=5, epochs=4, verbose=0,
                                       devices=devices(2))
    assert int(model.optimizer.iterations.numpy()) == 10 and history.epoch == [0, 1]


def test_a_stream_left_mid_pass_is_let_go_when_the_fit_returns(mnist):
    # steps_per_epoch keeps one pass open across epochs. The fit lets it go
    # as it returns, as model.fit's iterator is: the user's generator is
    # closed (its `finally` runs) with no garbage collection, so its
    # threads and files are not held until a full collection finds them.
    (x, y), _ = mnist
    events = []

    def batches():
        try:
            for i in range(0, 640, 32):  # 20 batches, 7 of them read
                events.append(i // 32)
                yield x[i:i + 32], y[i:i + 32]
        finally:
            events.append("closed")

    model = mlp()
    gc.disable()
    try:
        keras_dp.fit_sharded(model, batches(), steps_per_epoch=3, epochs=2, verbose=0,
                             devices=devices(2))
        assert events == [0, 1, 2, 3, 4, 5, "closed"]  # 6 steps read, none ahead
    finally:
        gc.enable()
    assert int(model.optimizer.iterations.numpy()) == 6


@pytest.mark.parametrize("steps_per_execution, steps_per_epoch, ends, steps", [
    (1, 3, [[0, 1, 2], [0], [0, 1, 2]], 7),  # 4 batches a pass: the pass ends epoch 2
    (1, 5, [[0, 1, 2, 3]] * 3, 12),  # more steps than a pass: one pass an epoch
    (2, 3, [[1, 3]] * 3, 12),  # whole calls: 3 steps round up to 4
    (3, 2, [[2], [2], [2]], 7),  # a call of 3 steps, then the pass's last batch alone
])
def test_steps_per_epoch_over_finite_data_counts_steps_as_model_fit(
        steps_per_execution, steps_per_epoch, ends, steps):
    # Keras keeps one iterator across epochs: an epoch runs whole calls of K
    # steps while fewer than steps_per_epoch have run, and ends where the
    # data does ("Your input ran out of data"); the next starts a new pass.
    # 20 rows in batches of 6: 4 batches a pass, the last of 2 rows.
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(20, 4)).astype("float32"), rng.integers(0, 3, 20)

    def model():
        keras.utils.set_random_seed(0)
        built = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        built.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True), steps_per_execution=steps_per_execution)
        return built

    ours, theirs = EpochEnds(), EpochEnds()
    options = dict(batch_size=6, steps_per_epoch=steps_per_epoch, epochs=3, shuffle=False,
                   verbose=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # both say that the data ran out
        ours_model = model()
        keras_dp.fit_sharded(ours_model, x, y, devices=devices(2), callbacks=[ours], **options)
        theirs_model = model()
        theirs_model.fit(x, y, callbacks=[theirs], **options)
    assert theirs.ends == ends
    assert ours.ends == ends
    assert int(theirs_model.optimizer.iterations.numpy()) == steps
    assert int(ours_model.optimizer.iterations.numpy()) == steps
    assert_weights_close(ours_model, theirs_model)


class EpochEnds(keras.callbacks.Callback):
    """Each epoch's `on_train_batch_end` indices, a list per epoch."""

    def __init__(self):
        super().__init__()
        self.ends = []

    def on_epoch_begin(self, epoch, logs=None):
        self.ends.append([])

    def on_train_batch_end(self, batch, logs=None):
        self.ends[-1].append(batch)


@pytest.mark.parametrize("bad, message", [
    (lambda x, y: (x[:0], y[:0]), "Batch 1 of epoch 1 has no rows"),
    (lambda x, y: (x[:32], y[:32], np.ones(32)), "Batch 1 of epoch 1 has a different structure"),
    (lambda x, y: (x[:32], y[:31]), "same number of rows"),
])
def test_a_bad_batch_in_a_dataset_is_named(mnist, bad, message):
    with pytest.raises(ValueError, match=message):
        keras_dp.fit_sharded(mlp(), batches_then(mnist, bad), verbose=0, devices=devices(2))


def test_a_dataset_of_single_samples_is_told_to_batch(mnist):
    (x, y), _ = mnist
    single = r"Batch 0 of epoch 1 is a single sample, not a batch: its arrays have shapes "
    with pytest.raises(ValueError, match=single + r"\[\(28, 28, 1\), \(\)\].*dataset.batch\(64\)"):
        keras_dp.fit_sharded(mlp(), tf.data.Dataset.from_tensor_slices((x[:8], y[:8])),
                             verbose=0, devices=devices(2))
    with pytest.raises(ValueError, match=single + r".*a generator or PyDataset yields arrays"):
        keras_dp.fit_sharded(mlp(), ((image, label) for image, label in zip(x, y)),
                             verbose=0, devices=devices(2))


def test_an_unbatched_dataset_of_one_hot_labels_is_told_to_batch(mnist):
    # image_dataset_from_directory(batch_size=None, label_mode="categorical")
    # gives an image (28, 28, 1) and a label (10,). Before, the message said only
    # that the arrays' rows differ, not that the dataset is not batched.
    (x, y), _ = mnist
    model = mlp()
    model.compile(optimizer="sgd", loss=keras.losses.CategoricalCrossentropy(from_logits=True))
    unbatched = tf.data.Dataset.from_tensor_slices((x[:8], np.eye(10)[y[:8]]))
    with pytest.raises(ValueError, match=r"Batch 0 of epoch 1 has arrays without the same number "
                       r"of rows .*: shapes \[\(28, 28, 1\), \(10,\)\]\. If each is one sample, the "
                       r"dataset is not batched: batch it, `dataset.batch\(64\)`"):
        keras_dp.fit_sharded(model, unbatched, verbose=0, devices=devices(2))


def batches_then(mnist, bad):
    (x, y), _ = mnist
    return [(x[:32], y[:32]), bad(x, y)]


def _rows(batch):
    return keras_dp.sharding.batch_rows(batch)


def test_group_steps_groups_k_equal_batches_and_runs_the_rest_alone():
    batches = [np.zeros((4, 1))] * 5 + [np.zeros((3, 1))]
    groups = list(keras_dp.core.feed.group_steps(batches, 2))
    assert [[_rows(b) for b in group] for group in groups] == [[4, 4], [4, 4], [4], [3]]
    # Taken K at a time from the start, as Keras's calls take them: a run
    # of K that changes shape runs alone, batch by batch.
    batches = [np.zeros((4, 1)), np.zeros((3, 1)), np.zeros((3, 1)), np.zeros((4, 1))] * 2
    groups = list(keras_dp.core.feed.group_steps(batches, 2))
    assert [[_rows(b) for b in group] for group in groups] == [[4], [3], [3], [4]] * 2
    groups = list(keras_dp.core.feed.group_steps(batches[1:], 2))
    assert [[_rows(b) for b in group] for group in groups] == [[3, 3], [4, 4], [3, 3], [4]]
    assert list(keras_dp.core.feed.group_steps(batches, 1)) == [[b] for b in batches]


def test_array_batches_use_every_row_once_in_a_seeded_order():
    x, y = np.arange(10.0)[:, None], np.arange(10)
    batches = keras_dp.sources.make_batches(x, y, batch_size=4, shuffle=True, seed=3)
    assert batches.steps == 3
    epoch0 = list(batches.epoch(0))
    assert [_rows(b) for b in epoch0] == [4, 4, 2]
    rows0 = np.concatenate([b[1] for b in epoch0])
    assert sorted(rows0) == list(range(10))
    again = np.concatenate([b[1] for b in batches.epoch(0)])
    epoch1 = np.concatenate([b[1] for b in batches.epoch(1)])
    np.testing.assert_array_equal(rows0, again)
    assert sorted(epoch1) == list(range(10)) and not np.array_equal(epoch1, rows0)
    np.testing.assert_array_equal(np.concatenate([b[0][:, 0] for b in epoch0]), rows0)


def test_class_weight_becomes_sample_weight_for_ids_and_one_hot():
    ids = np.array([0, 1, 2, 1])
    np.testing.assert_array_equal(
        keras_dp.sources.batch.class_weight_to_sample_weight(ids, {1: 3.0}), [1, 3, 1, 3])
    one_hot = np.eye(3)[ids]
    np.testing.assert_array_equal(
        keras_dp.sources.batch.class_weight_to_sample_weight(one_hot, {0: 0.5, 2: 2}), [0.5, 1, 2, 1])


def test_split_validation_holds_out_the_last_rows_before_shuffling():
    x, y = np.arange(10.0), np.arange(10)
    (x_train, y_train, _), (x_val, y_val, _) = keras_dp.sources.split_validation(x, y, None, 0.25)
    # floor(10 * 0.75) = 7 rows train, as in Keras's train_validation_split.
    np.testing.assert_array_equal(y_train, np.arange(7))
    np.testing.assert_array_equal(y_val, [7, 8, 9])
    with pytest.raises(ValueError, match="both need at least one"):
        keras_dp.sources.split_validation(x[:1], y[:1], None, 0.5)


class RunsOn(keras.callbacks.Callback):
    """Fails a fit that trains or validates past 20 batches: it would never end."""

    def on_train_batch_end(self, batch, logs=None):
        assert batch < 20, "ran on past 20 batches of an endless pass"

    on_test_batch_end = on_predict_batch_end = on_train_batch_end


class Endless(keras.utils.PyDataset):
    num_batches = None

    def __getitem__(self, index):
        return np.zeros((4, 28, 28, 1), "float32"), np.zeros(4, "int64")


def _endless_sources():
    import grain

    x, y = np.zeros((8, 28, 28, 1), "float32"), np.zeros(8, "int64")
    tf_repeat = tf.data.Dataset.from_tensor_slices((x, y)).batch(4).repeat()
    sampler = grain.samplers.IndexSampler(8, num_epochs=None, shuffle=False, seed=0)
    return {
        "a tf.data.Dataset that repeats forever": tf_repeat,
        "a keras.utils.PyDataset whose num_batches is None": Endless(),
        r"a Grain dataset that repeats forever \(repeat\(\) without num_epochs\)":
            grain.MapDataset.source(list(zip(x, y))).repeat().batch(4),
        "a grain.DataLoader whose sampler has num_epochs=None": grain.DataLoader(
            data_source=list(zip(x, y)), sampler=sampler,
            operations=[grain.transforms.Batch(4)]),
    }


@pytest.mark.parametrize("kind", range(4))
def test_an_endless_input_without_a_step_count_is_refused_before_any_step(kind):
    # Before, fit trained (or validated, or evaluated) forever, as model.fit does.
    pytest.importorskip("grain")
    what, data = list(_endless_sources().items())[kind]
    model = mlp()
    before = [w.copy() for w in model.get_weights()]
    finite = tf.data.Dataset.from_tensor_slices(
        (np.zeros((8, 28, 28, 1), "float32"), np.zeros(8, "int64"))).batch(4)
    fit = dict(verbose=0, devices=devices(2), callbacks=[RunsOn()])
    with pytest.raises(ValueError, match=f"`x` is {what}, and no `steps_per_epoch` says "
                       r"where a pass ends: it would run forever .* Pass `steps_per_epoch=N`"):
        keras_dp.fit_sharded(model, data, **fit)
    with pytest.raises(ValueError, match=f"`validation_data` is {what}, and no "
                       "`validation_steps`.* Pass `validation_steps=N`"):
        keras_dp.fit_sharded(model, finite, validation_data=data, **fit)
    trainer = keras_dp.ShardedTrainer(model, devices=devices(2))
    for run in (trainer.evaluate, trainer.predict):
        with pytest.raises(ValueError, match=f"`x` is {what}, and no `steps` .* Pass `steps=N`"):
            run(data, verbose=0, callbacks=[RunsOn()])
    for old, new in zip(before, model.get_weights(), strict=True):
        np.testing.assert_array_equal(old, new)
    # With a step count, it reads what it is told.
    history = keras_dp.fit_sharded(model, data, steps_per_epoch=3, validation_data=data,
                                   validation_steps=2, **fit)
    assert int(model.optimizer.iterations.numpy()) == 3 and len(history.history["val_loss"]) == 1
    if kind == 2:  # an IterDataset made from it is endless too, as is a repeat(2) not
        assert keras_dp.sources.make_batches(data.to_iter_dataset()).endless
        assert keras_dp.sources.make_batches(data.slice(slice(0, 4)).repeat(2)).endless is None


class Slices(keras.utils.PyDataset):
    """5 batches of 8 rows of `x, y` (the last of 7), recording which thread read each."""

    def __init__(self, x, y, **options):
        super().__init__(**options)
        self.x, self.y, self.threads = x, y, set()

    def __len__(self):
        return 5

    def __getitem__(self, index):
        import threading
        import time

        self.threads.add(threading.current_thread().name)
        time.sleep(0.02)  # slow enough that both workers take a batch
        return self.x[index * 8:(index + 1) * 8], self.y[index * 8:(index + 1) * 8]


@pytest.mark.parametrize("processes", [False, True])
def test_a_py_datasets_workers_read_ahead_in_threads_in_order(mnist, processes):
    # Before, `workers` was ignored without a word; now they read ahead, in
    # order, so the steps equal Keras's fit reading in one thread (Keras's
    # own fit with workers=2 starts each epoch at batch 1: it keeps batch 0
    # of the enqueuer for its build). `use_multiprocessing` reads in threads
    # too, and says so.
    (x, y), _ = mnist
    x, y = x[:39], y[:39]
    reference = sgd_mlp()
    reference.fit(Slices(x, y), epochs=2, shuffle=False, verbose=0)
    data = Slices(x, y, workers=2, use_multiprocessing=processes)
    model = sgd_mlp()
    if processes:
        with pytest.warns(UserWarning, match=r"keras_dp reads this PyDataset \(workers=2, "
                          r"use_multiprocessing=True\) in 2 threads of this process, not in "
                          r"processes.*grain.DataLoader with worker_count=N"):
            history = keras_dp.fit_sharded(model, data, epochs=2, shuffle=False, verbose=0,
                                           devices=devices(3))
    else:
        history = keras_dp.fit_sharded(model, data, epochs=2, shuffle=False, verbose=0,
                                       devices=devices(3))
    assert {name.rsplit("_", 1)[0] for name in data.threads} == {"keras_dp-pydataset"}
    assert len(data.threads) == 2
    np.testing.assert_allclose(history.history["loss"], reference.history.history["loss"],
                               rtol=1e-5)
    for ours, theirs in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5 * np.abs(theirs).max())


class Reshuffling(keras.utils.PyDataset):
    """5 batches of 8 rows, reshuffled in `on_epoch_end` as Keras's docs show; `log`: hooks, reads."""

    def __init__(self, x, y):
        super().__init__()
        self.x, self.y, self.log = x, y, []
        self.order, self.ends = np.arange(len(x)), 0

    def __len__(self):
        return 5

    def __getitem__(self, index):
        self.log.append(index)
        rows = self.order[index * 8:(index + 1) * 8]
        return self.x[rows], self.y[rows]

    def on_epoch_begin(self):
        self.log.append("begin")

    def on_epoch_end(self):
        self.log.append("end")
        self.ends += 1
        self.order = np.random.default_rng(self.ends).permutation(len(self.x))


def _hooks_of_a_program(fit, evaluate, predict, x, y):
    """Results, hooks and reads of fit (unbuilt), fit with validation, evaluate, and predict."""
    data, val = Reshuffling(x, y), Reshuffling(x[:20], y[:20])
    logs = [fit(data, epochs=2)["loss"]]
    logs.append(fit(data, epochs=2, validation_data=val, validation_steps=2))
    logs.append(evaluate(data))
    logs.append(evaluate(data, steps=2))
    logs.append(predict(data))
    return logs, data.log, val.log


def test_a_py_dataset_gets_the_hooks_keras_calls_before_its_first_epoch(mnist):
    # Keras's fit and evaluate call on_epoch_end once before the first epoch
    # (after a pass of their own to build from, on an unbuilt model), and
    # before each validation: a PyDataset that reshuffles there trains its
    # first epoch in its second order. keras_dp called on_epoch_begin for its
    # build read and never ended it, and read the first epoch in index order:
    # other losses and weights from the first epoch on.
    (x, y), _ = mnist
    x, y = x[:40], y[:40]
    reference = sgd_mlp()
    expected = _hooks_of_a_program(
        lambda data, **kw: reference.fit(data, shuffle=False, verbose=0, **kw).history,
        lambda data, **kw: reference.evaluate(data, verbose=0, return_dict=True, **kw),
        lambda data: reference.predict(data, verbose=0), x, y)
    model = sgd_mlp()
    trainer = keras_dp.ShardedTrainer(model, devices=devices(2))
    got = _hooks_of_a_program(
        lambda data, **kw: trainer.fit(data, shuffle=False, verbose=0, **kw).history,
        lambda data, **kw: trainer.evaluate(data, verbose=0, return_dict=True, **kw),
        lambda data: trainer.predict(data, verbose=0), x, y)
    assert got[1:] == expected[1:]
    losses, history, scores, first_scores, outputs = got[0]
    keras_losses, keras_history, keras_scores, keras_first_scores, keras_outputs = expected[0]
    np.testing.assert_allclose(losses, keras_losses, rtol=1e-5)
    for ours, theirs in [(history, keras_history), (scores, keras_scores),
                         (first_scores, keras_first_scores)]:
        for name in theirs:
            np.testing.assert_allclose(ours[name], theirs[name], rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(outputs, keras_outputs, rtol=0,
                               atol=1e-5 * np.abs(keras_outputs).max())
    assert_weights_close(model, reference)


def _image_folders(root, x, y):
    from PIL import Image

    for index, (image, label) in enumerate(zip(x, y)):
        (root / str(label)).mkdir(parents=True, exist_ok=True)
        Image.fromarray(image[..., 0]).save(root / str(label) / f"{index:03d}.png")
    return root


def _tfrecords(root, x, y):
    root.mkdir()
    for part in range(2):
        with tf.io.TFRecordWriter(str(root / f"part{part}.tfrecord")) as writer:
            for image, label in zip(x[part::2], y[part::2]):
                writer.write(tf.train.Example(features=tf.train.Features(feature={
                    "image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[image.tobytes()])),
                    "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
                })).SerializeToString())
    features = {"image": tf.io.FixedLenFeature([], tf.string),
                "label": tf.io.FixedLenFeature([], tf.int64)}

    def parse(record):
        example = tf.io.parse_single_example(record, features)
        image = tf.io.decode_raw(example["image"], tf.uint8)
        return tf.reshape(tf.cast(image, tf.float32), (28, 28, 1)), example["label"]

    files = tf.data.Dataset.list_files(str(root / "*.tfrecord"), seed=3)
    return lambda: (files.interleave(tf.data.TFRecordDataset, cycle_length=2)
                    .map(parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
                    .cache().shuffle(16, seed=2).batch(8).prefetch(tf.data.AUTOTUNE))


@pytest.mark.slow  # 20 s on the shared 2-core VM
def test_image_folders_and_tfrecords_from_disk_train_as_in_model_fit(mnist, tmp_path):
    # The audit's two most common disk inputs, read as keras.utils and tf.data
    # read them: PNG class folders split by `validation_split` and `subset`,
    # reshuffled each epoch, and TFRecord shards interleaved, parsed, cached,
    # reshuffled and batched by 8 rows on 3 devices. Losses, validation losses
    # and weights equal Keras's fit on one device.
    (x, y), _ = mnist
    folders = _image_folders(tmp_path / "images", x[:32], y[:32])

    def images(subset):
        return keras.utils.image_dataset_from_directory(
            folders, image_size=(28, 28), color_mode="grayscale", batch_size=8, seed=1,
            validation_split=0.25, subset=subset, verbose=False)

    records = _tfrecords(tmp_path / "records", x[:32], y[:32])
    for train, options in [(lambda: images("training"), lambda: dict(validation_data=images("validation"))),
                           (records, dict)]:
        reference = sgd_mlp()
        expected = reference.fit(train(), epochs=2, verbose=0, **options()).history
        model = sgd_mlp()
        history = keras_dp.fit_sharded(model, train(), epochs=2, verbose=0, devices=devices(3),
                                       **options()).history
        assert history.keys() == expected.keys()
        for name in expected:
            np.testing.assert_allclose(history[name], expected[name], rtol=1e-5)
        for ours, theirs in zip(model.get_weights(), reference.get_weights(), strict=True):
            np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5 * np.abs(theirs).max())


def test_a_reshuffled_tf_data_epoch_reads_the_order_of_an_unbroken_run_when_resumed():
    # shuffle(reshuffle_each_iteration=True) draws a new order per iterator made:
    # an unbroken fit reads epoch e as the (e + 2)-th (the first is read to
    # build). Before, a fit resumed in epoch 2 read it as the 2nd, so the
    # batches it skipped were not those trained on: some rows trained twice in
    # that epoch, others never (checked by hand: SIGTERM after 2 steps of
    # epoch 2 and the rerun ended 0.016 away from the unbroken run; now bitwise).
    def batches():
        dataset = tf.data.Dataset.range(12).shuffle(12, seed=4).batch(4)
        return keras_dp.sources.make_batches(dataset)

    def rows(epoch):
        return [batch[0].tolist() for batch in epoch]

    unbroken = batches()
    unbroken.peek()
    epochs = [rows(unbroken.epoch(epoch)) for epoch in range(3)]
    assert all(sorted(sum(epoch, [])) == list(range(12)) for epoch in epochs)
    assert epochs[1] != epochs[2]
    resumed = batches()
    resumed.peek()
    assert rows(resumed.epoch(1, skip=2)) == epochs[1][2:]
    assert rows(resumed.epoch(2)) == epochs[2]


def test_a_dataset_batch_is_named_with_the_same_epoch_number_by_every_check(mnist):
    # Epochs are counted from 1 in messages, as Keras's progress bar shows
    # them ("Epoch 1/2") and the label and shape checks name them. The
    # structure, row and empty-dataset checks said "epoch 0" for the same
    # first epoch, so one batch could be "batch 1 of epoch 0" in one
    # message and "batch 1 of epoch 1" in another.
    (x, y), _ = mnist
    first = (x[:32], y[:32])
    fit = dict(verbose=0, devices=devices(2))
    with pytest.raises(ValueError, match=r"^Batch 1 of epoch 1 has no rows"):
        keras_dp.fit_sharded(mlp(), [first, (x[:0], y[:0])], **fit)
    with pytest.raises(ValueError, match=r"^A label of batch 1 of epoch 1 of the training data"):
        keras_dp.fit_sharded(mlp(), [first, (x[:32], np.full(32, 10))], **fit)
    with pytest.raises(ValueError, match=r"^The training data, a list, yielded no batches: "
                       r"it is empty"):
        keras_dp.fit_sharded(mlp(), [], **fit)


def test_tensorflow_holding_the_gpus_already_is_said_not_passed_over(monkeypatch):
    # When TensorFlow has started with its GPUs visible, keras_dp can no
    # longer hide them, and TensorFlow may hold most of their memory: it
    # said nothing. (No GPU here: TensorFlow's answers are stood in for.)
    def started(devices, device_type):
        raise RuntimeError("Visible devices cannot be modified after being initialized")

    monkeypatch.setattr(tf.config, "set_visible_devices", started)
    monkeypatch.setattr(tf.config, "list_logical_devices", lambda kind: ["/device:GPU:0"])
    with pytest.warns(UserWarning, match="TensorFlow started before keras_dp could hide"):
        keras_dp.sources.tfdata.hide_gpus_from_tensorflow()
    monkeypatch.setattr(tf.config, "list_logical_devices", lambda kind: [])
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no GPU held: nothing to say
        keras_dp.sources.tfdata.hide_gpus_from_tensorflow()
