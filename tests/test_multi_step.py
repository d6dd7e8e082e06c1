"""steps_per_execution: K steps in one compiled call, exactly, in fit, evaluate and predict."""

import re

import jax
import keras
import numpy as np
import pytest

import keras_dp
from keras_dp import sources as pipeline
from conftest import BatchEnds, assert_close_to_scale, devices, mlp


@pytest.mark.parametrize("on_device, programs", [
    (False, ("train_step", "train_steps")), (True, ("resident_step", "resident_steps"))])
def test_the_multi_step_program_compiles_once_and_callbacks_see_each_group_of_k(
        mnist, on_device, programs):
    (x, y), _ = mnist
    record = BatchEnds()
    trainer = keras_dp.ShardedTrainer(mlp(), devices=devices(2), steps_per_execution=4,
                                      data_on_device=on_device)
    trainer.fit(x[:600], y[:600], batch_size=64, epochs=2, verbose=0, callbacks=[record])
    # 9 full batches and one of 24 rows: calls of 4, 4, then 1 and 1 alone,
    # which the hooks see as one group, as Keras's short last call: batch 11.
    assert record.ends == [3, 7, 11] * 2
    single, multi = (getattr(trainer.programs, name) for name in programs)
    assert multi._cache_size() == 1
    assert single._cache_size() == 2  # 64 rows and 24 rows


def test_steps_per_execution_comes_from_compile_and_scan_unrolls_on_cpu():
    model = mlp()
    model.compile(optimizer="adam", loss=model.loss, steps_per_execution=8)
    trainer = keras_dp.ShardedTrainer(model, devices=devices(2))
    assert trainer.steps_per_execution == 8
    with pytest.raises(ValueError, match="`steps_per_execution` is the number of steps.*at least 1. Received: steps_per_execution=0"):
        keras_dp.ShardedTrainer(mlp(), steps_per_execution=0)


@pytest.mark.parametrize("value", [0, -2])
def test_a_compiled_steps_per_execution_below_1_is_refused_not_read_as_1(value):
    # Keras's compile stores it as given (its fit then fails on 0 with "range()
    # arg 3 must not be zero"); keras_dp read 0 as 1 and trained silently.
    def build():
        model = mlp()
        model.compile(optimizer="sgd", loss=model.loss, steps_per_execution=value)
        return model

    message = rf"at least 1. Received: model.compile\(steps_per_execution={value}\)"
    with pytest.raises(ValueError, match=message):
        keras_dp.fit_sharded(build(), np.zeros((4, 28, 28, 1)), np.zeros(4), devices=devices(2))
    with pytest.raises(ValueError, match=message):
        keras_dp.fit_ensemble(build, np.zeros((4, 28, 28, 1)), np.zeros(4), devices=devices(2))


class EvaluateAndPredictEnds(keras.callbacks.Callback):
    """Records the batch index of every test and predict batch end, and each call's rows."""

    def __init__(self):
        super().__init__()
        self.test, self.predict = [], []

    def on_test_batch_end(self, batch, logs=None):
        self.test.append(batch)

    def on_predict_batch_end(self, batch, logs=None):
        self.predict.append((batch, len(logs["outputs"])))


def test_evaluate_predict_and_validation_run_k_steps_per_call_exactly(mnist):
    # 700 rows at batch 64 on 3 devices: 10 full batches (three calls of 3,
    # then 1 alone) and a 60-row batch, run alone; bitwise equal to K=1. The
    # last two are one group to the hooks, as Keras's short call: batch 11.
    (x, y), (x_test, y_test) = mnist
    x_val, y_val = x_test[:700], y_test[:700]
    results, records = {}, {}
    for k in (1, 3):
        trainer = keras_dp.ShardedTrainer(mlp(seed=3, dropout=0.5), devices=devices(3),
                                          steps_per_execution=k)
        history = trainer.fit(x[:320], y[:320], batch_size=64, verbose=0,
                              validation_data=(x_val, y_val))
        records[k] = EvaluateAndPredictEnds()
        scores = trainer.evaluate(x_val, y_val, batch_size=64, verbose=0, callbacks=[records[k]])
        outputs = trainer.predict(x_val, batch_size=64, verbose=0, callbacks=[records[k]])
        results[k] = (history.history, scores, outputs)
    assert results[3][0] == results[1][0]  # validation logs, bitwise
    assert results[3][1] == results[1][1]
    np.testing.assert_array_equal(results[3][2], results[1][2])
    assert results[3][2].shape == (700, 10)
    assert records[3].test == [2, 5, 8, 11]
    assert records[3].predict == [(2, 192), (5, 192), (8, 192), (11, 124)]
    assert records[1].test == list(range(11))
    assert trainer.programs.test_steps._cache_size() == 1
    assert trainer.programs.predict_steps._cache_size() == 1


@pytest.mark.parametrize("sharding", [pytest.param("optimizer", marks=pytest.mark.slow), "full"])
def test_a_rolled_k_step_program_under_a_split_state_equals_single_steps_bitwise(sharding):
    # Before the state's layout was pinned at the top of every step, the
    # while loop of a rolled scan (unroll=1, the default off CPU) let XLA's
    # sharding propagation give the carried weights the split layout of
    # their optimizer slots: the forward pass then ran column-split (rows
    # all-gathered, each logit an all-reduce of three partial sums) instead
    # of row-split as in the single step, 1e-8 apart after one step.
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((24,)), keras.layers.Dense(192, activation="relu"),
                              keras.layers.Dense(3)])  # 24x192: split on 3 devices
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    trainer = keras_dp.ShardedTrainer(model, devices=devices(3), state_sharding=sharding,
                                      unroll=1)
    rng = np.random.default_rng(0)
    batches = [(rng.normal(size=(7, 24)).astype("float32"), rng.integers(0, 3, 7))
               for _ in range(3)]
    trainer.build(batches[0])
    single = trainer.init_state()
    for batch in batches:
        single, single_logs = trainer.train_step(single, trainer.shard(batch))
    stack = keras_dp.sharding.to_device_stacked([pipeline.unpack(batch) for batch in batches],
                                                trainer.layout)
    multi, multi_logs, finite = trainer.programs.train_steps(trainer.init_state(), stack)
    assert int(finite) == 3
    assert float(multi_logs["loss"]) == float(single_logs["loss"])
    for ours, theirs in zip(jax.tree.leaves(multi), jax.tree.leaves(single), strict=True):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


def keras_and_sharded_at_k2():
    """`("keras", model)` then `("sharded", trainer)`: a fresh Dense(3) at steps_per_execution=2 each."""
    for fit in ("keras", "sharded"):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy",
                      steps_per_execution=2)
        yield fit, model if fit == "keras" else keras_dp.ShardedTrainer(model, devices=devices(2))


def test_model_checkpoint_save_freq_counts_k_step_calls_as_keras_does(tmp_path):
    # The leftover batches of an epoch (a full one and a partial one at K=2)
    # run one call each, and the hooks see them as one group, as Keras's one
    # short call: a callback counting batches by the hooks' indices saves
    # where Keras's does.
    x = np.random.default_rng(0).random((7 * 16 + 5, 4), "float32")  # 7 batches of 16, 1 of 5
    y = np.arange(len(x)) % 3
    saved = {}
    for fit, runner in keras_and_sharded_at_k2():
        directory = tmp_path / fit
        checkpoint = keras.callbacks.ModelCheckpoint(
            str(directory / "w{epoch}-{batch}.weights.h5"), save_weights_only=True, save_freq=3)
        runner.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False,
                   callbacks=[checkpoint])
        saved[fit] = sorted(path.name.split(".")[0] for path in directory.iterdir())
    assert saved["keras"] == ["w1-4", "w1-8", "w2-4", "w2-8", "w3-4", "w3-8"]
    assert saved["sharded"] == saved["keras"]


def test_a_leftover_validation_batch_is_reported_as_keras_reports_its_short_call():
    # 3 validation batches at K=2: Keras runs the last as a short call that
    # it reports as batch 3; keras_dp runs it alone and reports it so.
    x = np.random.default_rng(0).random((40, 4), "float32")
    y = np.arange(len(x)) % 3
    ends = {}
    for fit, runner in keras_and_sharded_at_k2():
        record = EvaluateAndPredictEnds()
        runner.fit(x, y, batch_size=16, verbose=0, validation_data=(x[:24], y[:24]),
                   validation_batch_size=8, callbacks=[record])
        ends[fit] = record.test
    assert ends == {"sharded": [1, 3], "keras": [1, 3]}


def test_steps_fewer_than_k_read_exactly_that_many_batches_where_keras_runs_a_whole_call():
    # steps=2 with steps_per_execution=3: Keras 3.15.1's predict returns 3
    # batches' rows (15) and its evaluate scores 3 batches; keras_dp reads
    # exactly 2, as model.predict and model.evaluate do with K=1.
    def build(k):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        model.compile("sgd", "mse", steps_per_execution=k)
        return model

    x = np.random.default_rng(0).random((40, 4)).astype("float32")
    y = np.zeros((40, 3), "float32")
    options = dict(batch_size=5, steps=2, verbose=0)
    assert build(3).predict(x, **options).shape == (15, 3)  # Keras: a whole call
    trainer = keras_dp.ShardedTrainer(build(3), devices=devices(2))
    assert_close_to_scale(trainer.predict(x, **options), build(1).predict(x, **options))
    np.testing.assert_allclose(trainer.evaluate(x, y, **options),
                               build(1).evaluate(x, y, **options), rtol=1e-6)


class EveryBarUpdate(keras.callbacks.ProgbarLogger):
    """Keras's progress bar, drawing every update (Keras's skips those within 0.05 s)."""

    def on_epoch_begin(self, epoch, logs=None):
        super().on_epoch_begin(epoch, logs)
        self.progbar.interval = 0


def bar_counts(out):
    """The `n/total` of every bar drawn in `out`, in order (`3/Unknown` while the total is)."""
    bars = re.sub(r"\x1b\[[0-9;]*m|Epoch \d+/\d+", "", out)
    return re.findall(r"\d+/(?:\d+|Unknown)", bars)


def test_the_bar_counts_k_step_groups_as_keras_does(capsys):
    # 10 batches at K=4 run calls of 4, 4, then 1 and 1, which the hooks see
    # as Keras's one short call: batch 12, "12/10", as Keras 3.15.1 shows it;
    # with a dataset of unknown length Keras's bar then takes 12 as the
    # total, and so does keras_dp's (Keras's own ProgbarLogger).
    tf = pytest.importorskip("tensorflow")
    x = np.random.default_rng(0).random((20, 4), "float32")
    y = np.arange(len(x)) % 3
    unknown = tf.data.Dataset.from_tensor_slices((x, y)).batch(2).filter(lambda *_: True)
    counts = {}
    for fit in ("keras", "sharded"):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy",
                      steps_per_execution=4)
        runner = model if fit == "keras" else keras_dp.ShardedTrainer(model, devices=devices(2))
        for data, batch_size in (((x, y), 2), ((unknown,), None)):
            runner.fit(*data, batch_size=batch_size, epochs=2, shuffle=False,
                       callbacks=[EveryBarUpdate()])
            counts[fit, len(data)] = bar_counts(capsys.readouterr().out)
    assert counts["keras", 2] == ["4/10", "8/10", "12/10", "10/10"] * 2
    assert counts["keras", 1][3:] == ["12/12", "4/12", "8/12", "12/12", "12/12"]
    assert counts["sharded", 2] == counts["keras", 2]
    assert counts["sharded", 1] == counts["keras", 1]
