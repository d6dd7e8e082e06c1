"""Interrupt `fit` with real SIGINTs at random moments; check what the model holds.

One trainer (so the steps compile once) trains a small MLP with Adam on 2
simulated devices, from the same initial state every trial. A first,
uninterrupted run records the trainable and optimizer values after every
step (a callback that reads `self.model` each batch). Each trial then
starts the same fit and a timer thread sends the process SIGINT at a
random moment within that run's length. Whatever the moment, the model
must afterwards equal, bitwise, the recorded state after its own optimizer
step count, and that count must be at least the number of steps callbacks
saw finish (the state of a completed step is never lost).

Prints one JSON line per trial: `{"steps": iterations held, "ended":
batches callbacks saw end, "interrupted": bool, "equal": bool}`, then a
summary line `{"trials": n, "bad": [...]}`. A script, so that the device
count is set before JAX starts.
"""

import argparse
import json
import os
import pathlib
import random
import re
import signal
import sys
import threading
import time

parser = argparse.ArgumentParser()
parser.add_argument("--trials", type=int, default=5)
parser.add_argument("--epochs", type=int, default=25)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--steps-per-execution", type=int, default=1)
parser.add_argument("--host", action="store_true", help="batches from the host, not resident")
args = parser.parse_args()
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["KERAS_BACKEND"] = "jax"
os.environ["KERAS_DP_COMPILATION_CACHE"] = "0"
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dp  # noqa: E402

ROWS, BATCH = 256, 32
STEPS = ROWS // BATCH  # 8 steps per epoch: epoch ends are frequent


class Counter(keras.callbacks.Callback):
    """Counts the steps whose calls ended, without touching `self.model`."""

    def __init__(self):
        super().__init__()
        self.epoch = self.ended = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.ended = self.epoch * STEPS + batch + 1


class Recorder(keras.callbacks.Callback):
    """Records the model's trainable and optimizer values after every call."""

    def __init__(self):
        super().__init__()
        self.states = {}

    def on_train_begin(self, logs=None):
        self.states[0] = snapshot(self.model)

    def on_train_batch_end(self, batch, logs=None):
        state = snapshot(self.model)
        self.states[int(state[-1][0])] = state


def snapshot(model):
    """Trainable values, optimizer values, and the optimizer's step count last."""
    values = [np.array(v.value) for v in model.trainable_variables]
    values += [np.array(v.value) for v in model.optimizer.variables]
    return values + [np.array([int(model.optimizer.iterations.numpy())])]


def main():
    rng = np.random.default_rng(args.seed)
    x = rng.normal(size=(ROWS, 16)).astype("float32")
    y = rng.integers(0, 10, size=ROWS)
    keras.utils.set_random_seed(args.seed)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    trainer = keras_dp.ShardedTrainer(
        model, devices=jax.devices()[:2], compilation_cache=False,
        steps_per_execution=args.steps_per_execution, data_on_device=not args.host)
    trainer.build((x[:BATCH], y[:BATCH]))
    variables = list(model.variables) + list(model.optimizer.variables)
    initial = [np.array(v.value) for v in variables]

    def fit(callbacks):
        return trainer.fit(x, y, batch_size=BATCH, epochs=args.epochs, verbose=0,
                           callbacks=callbacks, shuffle=True)

    def reset():
        for variable, value in zip(variables, initial):
            variable.assign(value)

    recorder = Recorder()
    fit([recorder])
    reset()
    start = time.perf_counter()
    fit([Counter()])  # compiled already: this is how long a fit takes
    length = time.perf_counter() - start
    bad = []
    chooser = random.Random(args.seed)
    for trial in range(args.trials):
        reset()  # before the timer starts: the signal must find training, not this
        result = interrupted_fit(fit, chooser.uniform(0, length))
        held = snapshot(model)
        steps = int(held[-1][0])
        expected = recorder.states.get(steps)
        result.update(steps=steps, equal=expected is not None and all(
            np.array_equal(a, b) for a, b in zip(held, expected, strict=True)))
        ok = (result["equal"] and result["ended"] <= steps
              <= result["ended"] + args.steps_per_execution
              and result["noted"] in (None, steps))
        if not ok:
            bad.append(trial)
        print(json.dumps(dict(result, trial=trial, ok=ok)), flush=True)
    print(json.dumps({"trials": args.trials, "bad": bad, "fit_s": round(length, 3)}), flush=True)


def interrupted_fit(fit, delay):
    """Run `fit` while a timer sends SIGINT after `delay` seconds."""
    counter = Counter()
    timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))
    interrupted, noted = False, None
    try:
        timer.start()
        fit([counter])
        timer.join()  # a signal after fit returned lands here, still caught
        time.sleep(0.05)
    except KeyboardInterrupt as error:
        interrupted = True
        noted = noted_steps(getattr(error, "__notes__", []))
    timer.join()
    return {"ended": counter.ended, "interrupted": interrupted, "noted": noted,
            "delay": round(delay, 4)}


def noted_steps(notes):
    """The optimizer steps the interrupt's note says the model holds, or None."""
    for note in notes:
        found = re.search(r"after (\d+) steps of epoch (\d+), the last step that completed", note)
        if found:
            return (int(found[2]) - 1) * STEPS + int(found[1])
    return None


if __name__ == "__main__":
    main()
