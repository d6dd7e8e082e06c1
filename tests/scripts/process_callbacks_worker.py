"""One of 2 processes whose callbacks write files or stop (tests/test_distributed.py).

`files DIR`: fits 2 epochs with ModelCheckpoint, CSVLogger, TensorBoard and
BackupAndRestore writing under DIR, and prints `SAVES <n>` (this process's
calls of `save_weights`); then a BackupAndRestore of DIR/backup resumes
(`CASE resumed: ...`), unless process 1 reads another directory (`CASE one
backup: ...`); then a callback stops both processes after batch
1 of epoch 1 (`CASE both: trained <n> steps`), and a callback stops both
processes' evaluate and predict after batch 1 (`CASE stopped: ...`); then the same writers, with
a state split across the processes, write under DIR-split/process<i>
(`CASE split: SAVES <n>`; the trained weights in DIR-split/trained<i>.npz);
then process 0 alone calls `evaluate`, which must time out (KERAS_DP_AGREEMENT_TIMEOUT) and say why:
`CASE evaluate: ...`.

`stop`: a callback stops process 1 only, after batch 1 of epoch 1, and
nothing catches what it raises.
"""

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dp  # noqa: E402
from keras_dp import distributed  # noqa: E402

distributed.initialize()

import jax  # noqa: E402

ME = jax.process_index()
SAVES = []
_save_weights = keras.Model.save_weights


def counted_save_weights(self, *args, **kwargs):
    SAVES.append(args[0] if args else kwargs["filepath"])
    return _save_weights(self, *args, **kwargs)


keras.Model.save_weights = counted_save_weights


def make_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    return model


def data(rows=32):
    x = np.random.default_rng(ME).normal(size=(rows, 3)).astype("float32")
    return x, x.sum(axis=1, keepdims=True)


def files(directory):
    callbacks = [
        keras.callbacks.ModelCheckpoint(os.path.join(directory, "w{epoch}.weights.h5"),
                                        save_weights_only=True),
        keras.callbacks.CSVLogger(os.path.join(directory, "log.csv")),
        keras.callbacks.TensorBoard(os.path.join(directory, "tb")),
        keras.callbacks.BackupAndRestore(os.path.join(directory, "backup"),
                                         delete_checkpoint=False),
    ]
    keras_dp.fit_sharded(make_model(), *data(), batch_size=16, epochs=2, verbose=0,
                         validation_data=data(8), callbacks=callbacks)
    print(f"SAVES {len(SAVES)}", flush=True)
    distributed.barrier("files written")
    # The backup (epoch 2 of 2 done), seen by process 0 only, then by both.
    for name, backup in [("one backup", "backup" if ME == 0 else "empty"),
                         ("resumed", "backup")]:
        try:
            history = keras_dp.fit_sharded(
                make_model(), *data(), batch_size=16, epochs=3, verbose=0,
                callbacks=[keras.callbacks.BackupAndRestore(os.path.join(directory, backup))])
            print(f"CASE {name}: trained epochs {history.epoch}", flush=True)
        except Exception as error:
            print(f"CASE {name}: {type(error).__name__}: {error}", flush=True)
    model = make_model()
    keras_dp.fit_sharded(model, *data(64), batch_size=16, epochs=2, verbose=0,
                         callbacks=[StopAfterBatch1((0, 1))])
    print(f"CASE both: trained {int(model.optimizer.iterations.numpy())} steps", flush=True)
    stopped_early(model)
    split_state(directory + "-split")
    if ME == 0:
        try:
            keras_dp.ShardedTrainer(make_model()).evaluate(*data(), verbose=0)
            print("CASE evaluate: returned", flush=True)
        except Exception as error:
            print(f"CASE evaluate: {type(error).__name__}: {error}", flush=True)


def split_state(directory):
    """A state split across the processes: process 0 alone writes, every process gathers.

    Each process names its own directory, so that the test sees who wrote.
    4 steps per epoch; the ModelCheckpoint saves every 2 steps, the last at
    the fit's last step.
    """
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64),  # a split kernel
                              keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    x = np.random.default_rng(ME).normal(size=(32, 64)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    mine = os.path.join(directory, f"process{ME}")
    os.makedirs(directory, exist_ok=True)
    SAVES.clear()
    callbacks = [
        keras.callbacks.ModelCheckpoint(os.path.join(mine, "w.weights.h5"),
                                        save_weights_only=True, save_freq=2),
        keras.callbacks.CSVLogger(os.path.join(mine, "log.csv")),
        keras.callbacks.TensorBoard(os.path.join(mine, "tb")),
        keras.callbacks.BackupAndRestore(os.path.join(mine, "backup")),
    ]
    keras_dp.fit_sharded(model, x, y, batch_size=16, epochs=2, verbose=0,
                         validation_data=(x[:8], y[:8]), state_sharding="full",
                         callbacks=callbacks)
    print(f"CASE split: SAVES {len(SAVES)}", flush=True)
    np.savez(os.path.join(directory, f"trained{ME}.npz"), *model.get_weights())


class StopAfterBatch1(keras.callbacks.Callback):
    def __init__(self, processes):
        super().__init__()
        self.processes = processes

    def on_train_batch_end(self, batch, logs=None):
        if batch == 1 and ME in self.processes:
            self.model.stop_training = True


class StopInferenceAfterBatch1(keras.callbacks.Callback):
    def on_test_batch_end(self, batch, logs=None):
        self.model.stop_evaluating = batch == 1

    def on_predict_batch_end(self, batch, logs=None):
        self.model.stop_predicting = batch == 1


def stopped_early(model):
    """Both processes stop evaluate and predict after batch 1 of 4 (8 rows each per batch)."""
    trainer = keras_dp.ShardedTrainer(model)
    x, y = data(32)
    stopped = trainer.evaluate(x, y, batch_size=16, verbose=0,
                               callbacks=[StopInferenceAfterBatch1()])
    first_two = trainer.evaluate(x[:16], y[:16], batch_size=16, verbose=0)
    rows = len(trainer.predict(x, batch_size=16, verbose=0,
                               callbacks=[StopInferenceAfterBatch1()]))
    print(f"CASE stopped: evaluate of 2 batches {stopped == first_two}, predicted {rows} rows",
          flush=True)


def stop():
    keras_dp.fit_sharded(make_model(), *data(64), batch_size=16, epochs=2, verbose=0,
                         callbacks=[StopAfterBatch1((1,))])


if sys.argv[1] == "files":
    files(sys.argv[2])
else:
    stop()
print("done", flush=True)
