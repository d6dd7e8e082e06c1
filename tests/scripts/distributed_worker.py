"""One process of a multi-process test run.

Started by tests/test_distributed.py, through `keras-dp launch` or directly,
with the KERAS_DP_* variables of `keras_dp.distributed.initialize`. Writes
what the test compares to `--out` as `process<i>.npz`.

Tasks:
    fit: a small regression whose labels are row ids, on this process's
        share of `--rows` rows: process p of P holds, for every global step
        s, rows `s*B + p*B/P` to `s*B + (p+1)*B/P` (cut at the end), so the
        global batches are the rows in order whatever P (one process on all
        devices, unshuffled, trains on the same batches), and the last step
        leaves some shares short or empty. A metric counts every row id
        seen. With `--checkpoint-dir` it checkpoints, and `--signal` sends
        this process a signal during training; with `--extras` it also fits
        the same shares as a list of batches (a dataset) and predicts.
    forever: train until killed, printing `training` once steps run.
"""

import argparse
import os
import signal
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("task", choices=["fit", "forever"])
parser.add_argument("--out", required=True)
parser.add_argument("--rows", type=int, default=798)
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--steps-per-execution", type=int, default=4)
parser.add_argument("--checkpoint-dir")
parser.add_argument("--signal", help="NAME:PROCESS:EPOCH:STEP, e.g. SIGTERM:1:1:5")
parser.add_argument("--extras", action="store_true")
args = parser.parse_args()
os.environ.setdefault("KERAS_BACKEND", "jax")
# TensorFlow is installed for the suite's tf.data tests, and
# keras.utils.set_random_seed imports it whenever it can, to seed it too:
# 4 to 8 s per process on the 2-core VM. This worker feeds arrays and lists,
# so importing TensorFlow fails here instead.
sys.modules["tensorflow"] = None

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dp  # noqa: E402
from keras_dp import distributed  # noqa: E402

distributed.initialize()

import jax  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from many_hosts_data import make_model, rows_of, share_ids  # noqa: E402


def count_host_collectives():
    """Count calls of JAX's blocking host collectives (`multihost_utils`), by name.

    `broadcast_one_to_all` moves host values (a model read); a split state's
    gather goes through `process_allgather`; `sync_global_devices` is a barrier.
    """
    from jax.experimental import multihost_utils

    calls = dict.fromkeys(["broadcast_one_to_all", "process_allgather",
                           "sync_global_devices"], 0)

    def counted(name):
        original = getattr(multihost_utils, name)

        def call(*a, **k):
            calls[name] += 1
            return original(*a, **k)
        return call

    for name in calls:
        setattr(multihost_utils, name, counted(name))
    return calls


HOST_COLLECTIVES = count_host_collectives()


class Recorder(keras.callbacks.Callback):
    """Records the first batch end seen; sends a signal at a chosen step."""

    def __init__(self, spec):
        super().__init__()
        self.first, self.epoch, self.spec, self.sent = None, None, None, False
        if spec:
            name, process, epoch, step = spec.split(":")
            if int(process) == jax.process_index():
                self.spec = (getattr(signal, name), int(epoch), int(step))

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        if epoch == 1:
            self.before_epoch_1 = dict(HOST_COLLECTIVES)

    def on_train_batch_end(self, batch, logs=None):
        self.first = self.first or (self.epoch, batch)
        if self.sent:
            # JAX's runtime looks for SIGTERM once a second: slow the steps
            # (every process waits for this one) so that training is still
            # running when the notice arrives.
            time.sleep(0.3)
        elif self.spec and self.epoch == self.spec[1] and batch + 1 >= self.spec[2]:
            print(f"sending {self.spec[0].name} after step {batch + 1}", flush=True)
            self.sent = True
            os.kill(os.getpid(), self.spec[0])


def fit():
    ids = share_ids(args.rows, args.batch_size, jax.process_index(), jax.process_count())
    x, y = rows_of(ids, args.rows)
    model = make_model(args.rows)
    refused = False
    try:
        keras_dp.ShardedTrainer(model).fit(x, y, batch_size=args.batch_size + 1, verbose=0)
    except ValueError as error:
        refused = "must divide" in str(error)
    trainer = keras_dp.ShardedTrainer(model, steps_per_execution=args.steps_per_execution)
    recorder = Recorder(args.signal)
    history = trainer.fit(x, y, batch_size=args.batch_size, epochs=args.epochs,
                          shuffle=False, verbose=1, callbacks=[recorder],
                          checkpoint_dir=args.checkpoint_dir)
    results = dict(
        counts=np.asarray(history.history["ids"][-1]),
        iterations=int(model.optimizer.iterations.numpy()),
        rounds_per_epoch=trainer.hosts.exchange.rounds / args.epochs,
        # Blocking host collectives after epoch 0's start, by name.
        host_collectives=np.asarray(list(HOST_COLLECTIVES.values())),
        host_collectives_after_epoch_0=np.asarray([
            calls - getattr(recorder, "before_epoch_1", HOST_COLLECTIVES)[name]
            for name, calls in HOST_COLLECTIVES.items()]),
        first=np.asarray(recorder.first), refused=refused,
    )
    if args.extras:
        results.update(extras(trainer, x, y))
    np.savez(os.path.join(args.out, f"process{jax.process_index()}.npz"),
             *[np.asarray(w) for w in model.get_weights()], **results)


def extras(trainer, x, y):
    """A dataset fit on the same shares, and predict in K-step calls."""
    local = args.batch_size // jax.process_count()
    batches = [(x[i:i + local], y[i:i + local]) for i in range(0, len(x), local)]
    model = make_model(args.rows)
    dataset_trainer = keras_dp.ShardedTrainer(model, steps_per_execution=args.steps_per_execution)
    dataset_trainer.fit(batches, epochs=args.epochs, verbose=0)
    return dict(
        dataset_weights=np.concatenate([np.ravel(w) for w in model.get_weights()]),
        dataset_rounds_per_epoch=dataset_trainer.hosts.exchange.rounds / args.epochs,
        predictions=trainer.predict(x, batch_size=args.batch_size, verbose=0),
        expected=trainer.model.predict(x, verbose=0),
        # On process 0 alone, as a user prints it (before, a device
        # all-gather of the host names that process 1 never joined).
        description=trainer.describe() if jax.process_index() == 0 else "",
        ensemble_refused=_ensemble_refused(x, y),
    )


def _ensemble_refused(x, y):
    """Whether fit_ensemble refuses a mesh across processes before training."""
    try:
        keras_dp.fit_ensemble(lambda: make_model(args.rows), x, y, epochs=1, verbose=0)
    except ValueError as error:
        return "Ensembles train in one process" in str(error)
    return False


def forever():
    ids = share_ids(args.rows, args.batch_size, jax.process_index(), jax.process_count())
    x, y = rows_of(ids, args.rows)

    class Announce(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch >= 2:
                print("training", flush=True)

    keras_dp.fit_sharded(make_model(args.rows), x, y, batch_size=args.batch_size,
                         epochs=10_000, verbose=0, callbacks=[Announce()])


if __name__ == "__main__":
    {"fit": fit, "forever": forever}[args.task]()
    print(f"done {args.task}", flush=True)
    sys.exit(0)
