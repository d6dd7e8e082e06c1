"""One of 2 processes whose fits differ on purpose (tests/test_distributed.py).

Each case is a fit in which process 1 does something process 0 does not;
every process catches what its fit raises and prints `CASE <name>: <type>:
<message>`, then goes on to the next case (the processes stay in step).
The last case, `stop`, has a callback stop training on process 1 only,
after epoch 1, and prints each process's optimizer iterations. Then
`evaluate` with another batch size, and `predict` of no rows, on process 1.

The argument is a directory for process 1's `checkpoint_dir` case; with
`raise` instead, a callback raises on process 1 only, after
epoch 1, and nothing catches it; with `caught`, process 1 alone catches
it, prints `CAUGHT <message>` and ends with status 0 (`caught 0`: process
0 fails and catches), after a fit in which every process raises and catches
(`CASE after an error on every process: ...`); with `unwritable DIR`,
process 1 alone fails to open `checkpoint_dir=DIR` and catches that; with
`same_rows`, every process passes the same arrays (then batches), then its own;
with `read_on_0`, a callback reads the split state on every process, then on
process 0 alone.
"""

import os
import sys

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

ME = jax.process_index()


def make_model(width=4):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(width),
                              keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    return model


def data(rows=16):
    x = np.random.default_rng(ME).normal(size=(rows, 3)).astype("float32")
    return x, x.sum(axis=1, keepdims=True)


class StopOnProcess1(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if ME == 1:
            self.model.stop_training = True


def case(name, width=4, rows=16, callbacks=(), **fit):
    model = make_model(width)
    x, y = data(rows)
    fit = dict(dict(batch_size=8, epochs=2, shuffle=False, verbose=0), **fit)
    try:
        keras_dp.fit_sharded(model, x, y, callbacks=list(callbacks), **fit)
        print(f"CASE {name}: trained {int(model.optimizer.iterations.numpy())} steps", flush=True)
    except Exception as error:
        print(f"CASE {name}: {type(error).__name__}: {error}", flush=True)


FAILING = int(sys.argv[2]) if sys.argv[1] == "caught" and len(sys.argv) > 2 else 1


class RaiseOn(keras.callbacks.Callback):
    def __init__(self, processes=(FAILING,)):
        super().__init__()
        self.processes = processes

    def on_epoch_end(self, epoch, logs=None):
        if ME in self.processes:
            raise RuntimeError(f"a callback failed on process {ME}")


other = ME == 1
if sys.argv[1] == "raise":
    print("training", flush=True)
    keras_dp.fit_sharded(make_model(), *data(), batch_size=8, epochs=3, verbose=0,
                         callbacks=[RaiseOn()])
if sys.argv[1] == "caught":
    # Every process raises at the same point and catches it: none is stopped.
    try:
        keras_dp.fit_sharded(make_model(), *data(), batch_size=8, epochs=3, verbose=0,
                             callbacks=[RaiseOn((0, 1))])
    except RuntimeError:
        case("after an error on every process", epochs=1)
    # One process alone catches its error and goes on.
    print("training", flush=True)
    try:
        keras_dp.fit_sharded(make_model(), *data(), batch_size=8, epochs=3, verbose=0,
                             callbacks=[RaiseOn()])
    except RuntimeError as error:
        if ME != FAILING:
            raise
        print(f"CAUGHT {error}", flush=True)
    print("done", flush=True)
    sys.exit(0)
if sys.argv[1] == "same_rows":
    # The whole data passed on every process (no process_share, no shard),
    # then each process's own rows, as arrays and as a list of batches:
    # prints how many same-data warnings each fit gave, and its steps.
    import warnings

    whole = np.random.default_rng(7).normal(size=(16, 3)).astype("float32")
    for name, x in [("whole", whole), ("shares", data()[0])]:
        y = x.sum(axis=1, keepdims=True)
        listed = [(x[i:i + 4], y[i:i + 4]) for i in range(0, len(x), 4)]
        for kind, arguments in [("arrays", dict(x=x, y=y, batch_size=8)),
                                ("batches", dict(x=listed))]:
            model = make_model()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                keras_dp.fit_sharded(model, epochs=1, verbose=0, **arguments)
            same = [w for w in caught if "the same training arrays" in str(w.message)
                    or "first training batch is the same" in str(w.message)]
            steps = int(model.optimizer.iterations.numpy())
            print(f"WARNED {name} {kind} {len(same)} STEPS {steps}", flush=True)
    sys.exit(0)
if sys.argv[1] == "read_on_0":
    # With the state split across processes, a callback reads the model
    # after batch 2 on every process (fine), then on process 0 alone
    # (`if is_primary(): self.model...`), whose read would gather alone.
    class ReadAfterBatch2(keras.callbacks.Callback):
        def __init__(self, processes):
            super().__init__()
            self.processes = processes

        def on_train_batch_end(self, batch, logs=None):
            if batch == 2 and ME in self.processes:
                weights = self.model.get_weights()
                print(f"READ {float(np.abs(weights[0]).sum()):.6f}", flush=True)

    x, y = data(64)
    for name, readers in [("every process", (0, 1)), ("process 0 alone", (0,))]:
        model = make_model(64)
        keras_dp.fit_sharded(model, x, y, batch_size=16, epochs=1, verbose=0,
                             state_sharding="full", callbacks=[ReadAfterBatch2(readers)])
        print(f"TRAINED {name} {int(model.optimizer.iterations.numpy())}", flush=True)
    sys.exit(0)
if sys.argv[1] == "unwritable":
    # Process 1 alone cannot write the shared checkpoint directory (another
    # user's mount, say): its fit fails as it opens the checkpoints, and it
    # catches that and goes on, while process 0 opens them and trains.
    from keras_dp.checkpoint import integrity as checkpoint_guard

    def refuse(directory):
        raise PermissionError(f"checkpoint_dir {directory} cannot be written to on process {ME}")

    if ME == 1:
        checkpoint_guard.check_writable = refuse
    print("training", flush=True)
    try:
        keras_dp.fit_sharded(make_model(), *data(), batch_size=8, epochs=2, verbose=0,
                             checkpoint_dir=sys.argv[2])
    except PermissionError as error:
        print(f"CAUGHT {error}", flush=True)
    print("done", flush=True)
    sys.exit(0)
case("batch_size", batch_size=16 if other else 8)
case("epochs", epochs=3 if other else 2)
case("validation", validation_data=data(4) if other else None)
case("width", width=8 if other else 4)
case("checkpoint_dir", checkpoint_dir=sys.argv[1] if other else None)
case("no rows", rows=0 if other else 16)
case("stop", epochs=4, callbacks=[StopOnProcess1()])
trainer = keras_dp.ShardedTrainer(make_model())
for name, call in [("evaluate", lambda: trainer.evaluate(*data(), batch_size=16 if other else 8,
                                                        verbose=0)),
                   ("predict", lambda: trainer.predict(data(0 if other else 16)[0], verbose=0))]:
    try:
        call()
        print(f"CASE {name}: returned", flush=True)
    except Exception as error:
        print(f"CASE {name}: {type(error).__name__}: {error}", flush=True)
print("done", flush=True)
sys.exit(0)
