"""A chaos soak: a job with checkpoint_dir, faulted at random and requeued until it finishes.

A supervisor runs a small training job the way a scheduler runs and requeues
one (SLURM's `--requeue`, a Kubernetes Job's restarts): P processes of 2 CPU
devices each, joined through `keras_dp.distributed.initialize`, fitting with a
`checkpoint_dir`. It injects faults at random: SIGTERM or SIGKILL to a random
process at a random moment (inside a compile, a step, validation, a save, a
restore, or the first step after a resume), a second SIGTERM during the save
the first one started, and requeues the job, now and then on 1 or 3 processes
instead of 2, until it finishes. Then it checks:

- the final weights equal an unbroken run's on 2 processes (bitwise where
  every run of the job had its topology, else within float32 summation order);
- every row was trained once in the last epoch, no completed epoch was
  trained twice (each run resumed at or after the newest checkpoint saved
  before it), and no run read a checkpoint that was not complete when it
  started;
- after a SIGTERM every process saved and exited 143; after a SIGKILL every
  other process exited 75 within the heartbeat timeout (and the watcher's
  poll) with keras_dp's one line naming the killed process; no process hung.

It prints each fault, what it cost (seconds from the signal until every
process had exited, seconds until the requeued job trained its first step,
and the steps trained again), and a summary.

    python scripts/soak.py --faults 20 --seed 0          # the soak
    python scripts/soak.py job --out DIR [...]           # one process of the job

`job` is what each process runs (tests/test_preemption.py runs it too).
"""

import argparse
import os
import re
import signal
import sys
import time

ROWS, BATCH, EPOCHS = 470, 48, 4  # 10 steps an epoch, the last of 38 rows
DEVICES_PER_PROCESS = 2


# -- The job: one process of it ------------------------------------------------


def job_arguments(argv):
    parser = argparse.ArgumentParser(prog="soak.py job")
    parser.add_argument("--out", required=True, help="where process<i>.npz is written")
    parser.add_argument("--source", choices=["arrays", "grain"], default="arrays")
    parser.add_argument("--rows", type=int, default=ROWS)
    parser.add_argument("--batch-size", type=int, default=BATCH)
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--checkpoint-dir")
    parser.add_argument("--validation", action="store_true")
    parser.add_argument("--x64", action="store_true", help="train in float64")
    parser.add_argument("--sigterm-after", help="EPOCH:STEP: the last process sends itself "
                                                "SIGTERM after that step (0-based epoch)")
    return parser.parse_args(argv)


def job(argv):
    """One process of the job: fit, print where it stands, write its results."""
    args = job_arguments(argv)
    os.environ.setdefault("KERAS_BACKEND", "jax")
    sys.modules["tensorflow"] = None  # keras.utils.set_random_seed would import it: seconds
    import numpy as np

    from keras_dp import distributed

    if int(os.environ.get(distributed.NUM_PROCESSES_ENV, "1")) > 1:
        distributed.initialize()
    import jax
    import keras

    import keras_dp

    if args.x64:
        jax.config.update("jax_enable_x64", True)
        keras.config.set_floatx("float64")
    _instrument()
    dtype = "float64" if args.x64 else "float32"
    x = np.random.default_rng(0).normal(size=(args.rows, 8)).astype(dtype)
    y = np.arange(args.rows, dtype=dtype)[:, None]
    data = dict(x=x, y=y, batch_size=args.batch_size, shuffle=True)
    if args.source == "grain":
        data = dict(x=_elastic(x, y, args.batch_size))
    model = _model(args.rows)
    history = keras_dp.ShardedTrainer(model, steps_per_execution=1).fit(
        **data, epochs=args.epochs, verbose=0, checkpoint_dir=args.checkpoint_dir,
        validation_data=(x[:96], y[:96]) if args.validation else None,
        callbacks=[_markers(args.sigterm_after)])
    os.makedirs(args.out, exist_ok=True)
    np.savez(os.path.join(args.out, f"process{jax.process_index()}.npz"),
             *[np.asarray(w) for w in model.get_weights()],
             ids=np.asarray(history.history["ids"][-1]) if history.epoch else np.zeros(0),
             epochs=np.asarray(history.epoch, np.int64))
    _say("done")


def _elastic(x, y, batch_size):
    """The rows as a Grain `ElasticIterator`: each process its share of every global batch."""
    import grain

    dataset = grain.MapDataset.source(range(len(x))).shuffle(seed=3).map(
        lambda i: (x[i], y[i]))
    return grain.experimental.ElasticIterator(dataset, batch_size,
                                              grain.sharding.ShardByJaxProcess())


def _model(rows):
    """A seeded two-layer regression onto row id / rows, with Adam and a histogram of row ids."""
    import keras

    class RowIds(keras.metrics.Metric):
        """How often each row id (the label) was trained on in the epoch."""

        def __init__(self, name="ids"):
            super().__init__(name=name)
            self.counts = self.add_variable((rows,), initializer="zeros", name="counts")

        def update_state(self, y_true, y_pred, sample_weight=None):
            ids = keras.ops.cast(keras.ops.reshape(y_true, (-1,)), "int32")
            self.counts.assign_add(keras.ops.sum(keras.ops.one_hot(ids, rows), axis=0))

        def result(self):
            return keras.ops.convert_to_tensor(self.counts)

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=lambda t, p: keras.ops.mean(keras.ops.square(t / rows - p), axis=-1),
                  metrics=[RowIds()])
    return model


def _say(*words):
    print("PHASE", *words, flush=True)


def _instrument():
    """Print where a save and a restore start and end (the supervisor aims its signals at them)."""
    from keras_dp.checkpoint import integrity
    from keras_dp.checkpoint import store

    save, newest = store.Checkpoints.save, integrity.newest_intact

    def saving(self, state, position, seed):
        _say("save", position.epoch, position.steps)
        save(self, state, position, seed)
        _say("saved", self._manager.latest_step(), position.epoch, position.steps)

    def restoring(manager, template, restore_args):
        if manager.all_steps():
            _say("restore")
        tree, index = newest(manager, template, restore_args)
        if tree is not None:
            _say("restored", index, int(tree["position"]["epoch"]),
                 int(tree["position"]["steps"]))
        return tree, index

    store.Checkpoints.save, integrity.newest_intact = saving, restoring


def _markers(sigterm_after=None):
    """A callback that prints each step and validation, and sends SIGTERM at `sigterm_after`.

    `sigterm_after` ("EPOCH:STEP"): the last process sends it to itself
    after that step, then slows its steps so that JAX's notice of it
    arrives before the epoch ends.
    """
    import jax
    import keras

    class Markers(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.epoch, self.calls, self.sent = 0, 0, False
            self.at = tuple(map(int, sigterm_after.split(":"))) if sigterm_after else None

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_begin(self, batch, logs=None):
            if self.calls == 0:  # the first call of this run compiles
                _say("resumed-step" if (self.epoch, batch) != (0, 0) else "compile",
                     self.epoch, batch)
            self.calls += 1
            _say("step", self.epoch, batch)

        def on_train_batch_end(self, batch, logs=None):
            if self.sent:
                time.sleep(0.5)
            elif (self.at is not None and (self.epoch, batch + 1) >= self.at
                  and jax.process_index() == jax.process_count() - 1):
                self.sent = True
                os.kill(os.getpid(), signal.SIGTERM)

        def on_test_begin(self, logs=None):
            _say("validation")

    return Markers()


if __name__ == "__main__" and sys.argv[1:2] == ["job"]:
    job(sys.argv[2:])
