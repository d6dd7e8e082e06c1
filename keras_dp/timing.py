"""Where an epoch's time goes, and a profiler trace of a few steps.

`EpochTimer` splits one epoch's wall time into the parts the loop already
separates. The loop marks the end of each part (`lap`) with
`time.perf_counter` at points where it passes anyway, so timing adds no
device synchronisation, and every moment of the epoch belongs to exactly
one part: the parts add up to the epoch's wall time.

- `input_s`: waiting for the next batch (or stack of K) from the input
  pipeline and its copy to the devices (`placement.steps`; near 0 when the
  look-ahead thread keeps up, or with data on the devices), and the Python
  interpreter that thread holds meanwhile;
- `steps_s`: dispatching the compiled calls and waiting on the bound of
  steps in flight (`inflight.Throttle`), the compilation of the first call
  included, and the wait for the last calls at the epoch's end;
- `callbacks_s`: the callbacks' epoch and batch hooks, including writing
  the state back into the model when a callback looks at it;
- `validation_s`: scoring the validation data, its callbacks included;
- `other_s`: the rest: resetting the metrics, reading the model, the logs
  to Python floats.

`ShardedTrainer.timings` holds one `EpochTimer.result()` per epoch of the
last `fit`. `Profile` writes a `jax.profiler` trace of a few calls of the
first epoch, after the first call (which compiles).
"""

import time

import jax

PARTS = ("input_s", "steps_s", "callbacks_s", "validation_s")


class EpochTimer:
    """The seconds of one epoch, by part (see the module doc).

    Started when made; `lap(name)` counts the time since the previous lap
    (or the start) towards part `name`; `samples` counts the rows trained on.
    """

    def __init__(self, epoch):
        self.epoch = epoch
        self.samples = 0
        self.seconds = dict.fromkeys(PARTS + ("other_s",), 0.0)
        self._start = self._last = time.perf_counter()

    def lap(self, name):
        """End a part: the seconds since the previous lap go to `name`."""
        now = time.perf_counter()
        self.seconds[name] += now - self._last
        self._last = now

    def result(self):
        """The epoch's breakdown: a dict of seconds, samples and samples per second.

        Keys: `epoch`, `wall_s` (from the start of the epoch to now, the
        end of its `on_epoch_end` callbacks), the parts of `PARTS` and
        `other_s` (which add up to `wall_s`: the time since the last lap
        goes to `other_s`), `samples`, and `samples_per_s`: the samples
        over the epoch's wall time without validation.
        """
        self.lap("other_s")
        wall = self._last - self._start
        training = wall - self.seconds["validation_s"]
        return {
            "epoch": self.epoch, "wall_s": wall, **self.seconds, "samples": self.samples,
            "samples_per_s": self.samples / training if training > 0 else 0.0,
        }


def describe(entry):
    """One line for an epoch's `EpochTimer.result()`: the parts and samples per second."""
    parts = ", ".join(f"{name[:-2]} {entry[name]:.2f} s" for name in PARTS + ("other_s",))
    return (f"epoch {entry['epoch'] + 1} time {entry['wall_s']:.2f} s: {parts}; "
            f"{entry['samples_per_s']:,.0f} samples/s")


class Profile:
    """A `jax.profiler` trace of `calls` compiled calls after the first.

    `after_call(count)` is told how many calls of the traced epoch have been
    dispatched: the trace starts after the first (its compilation stays
    out) and stops after `calls` more, once the last of them is finished;
    `close` stops it at the epoch's end, or if training ends early.

    Args:
        directory: where `jax.profiler.start_trace` writes (a TensorBoard
            log directory: `plugins/profile/<run>/*.xplane.pb`).
        calls: how many calls to trace.
    """

    def __init__(self, directory, calls=5):
        self.directory, self.calls = str(directory), calls
        self._state = "waiting"

    def after_call(self, count, logs):
        """Start or stop the trace after the `count`-th call (whose logs are `logs`)."""
        if self._state == "waiting" and count == 1:
            jax.profiler.start_trace(self.directory)
            self._state = "tracing"
        elif self._state == "tracing" and count == 1 + self.calls:
            jax.block_until_ready(logs)  # the traced calls run inside the trace
            self.close()

    def close(self):
        """Stop the trace if it is running; no later call starts it again."""
        if self._state == "tracing":
            jax.profiler.stop_trace()
        self._state = "done"
