"""The loop of `fit`, as short functions, in the order they run.

`fit` runs epochs; each epoch is `start_epoch` (callbacks, the state in),
`train_batches` (batches from a feed, `keras_dp.core.feed`: host batches
placed on the devices, or rows gathered from data kept there; one compiled
call per step or per K steps, callbacks around each), `validate`
(`keras_dp.core.evaluate.evaluate` with the live weights), and the epoch's
end (`end_at`: a checkpoint, a preemption exit). The state of the epoch
in progress is held by a `keras_dp.core.live.LiveModel`, so that a
callback, an exception or an interrupt always finds the Keras model
current. Each epoch's time is split by part as it goes (`EpochTimer`).

Every function takes the `FitRun` of one fit: the trainer whose parts it
runs (its `model`, `hosts`, programs, `steps_per_execution` and
`steps_in_flight`), its source, feed, callbacks and checkpoints. What
differs across processes is the hosts' (`keras_dp.multihost.hosts`).
"""

import contextlib
import dataclasses
import os
import time

import jax

from keras_dp import _compat
from keras_dp import options
from keras_dp.checks import errors as explain
from keras_dp.checks import model as model_checks
from keras_dp.core import evaluate as inference
from keras_dp.core import programs as programs_lib
from keras_dp.core import state as state_lib
from keras_dp.core.feed import Cadence
from keras_dp.core.live import LiveModel
from keras_dp.core.live import Position
from keras_dp.core.live import Throttle
from keras_dp.core.live import failure_message
from keras_dp.keras import callbacks as callbacks_lib


@dataclasses.dataclass
class FitRun:
    """What every epoch of one `fit` shares."""

    trainer: object
    batches: object
    live: LiveModel
    callbacks: object
    feed: object = None
    checkpoints: object = None
    preemption: object = None
    profile: object = None  # a `Profile` of the first epoch
    timer: object = None  # the `EpochTimer` of the epoch in progress
    validation: object = None  # the validation's `programs.EvalPrograms`
    peak_flops_per_s: float | None = None  # the devices' together, where known

    @property
    def model(self):
        """The Keras model being trained."""
        return self.trainer.model

    @property
    def hosts(self):
        """What differs across processes (`keras_dp.multihost.hosts`)."""
        return self.trainer.hosts


def fit(trainer, batches, val, callbacks, *, verbose, epochs, resume, validation_freq,
        checkpoints=None, plan=None, profile_dir=None, peak_flops_per_s=None):
    """Train from `resume` to epoch `epochs - 1`; return the model's History.

    Makes the `CallbackList` of `callbacks` (`verbose` as in `model.fit`:
    History and the progress bar, on process 0) and the fit's feed
    (`trainer.use_feed`, from `plan`, the step's `MemoryPlan` where fit made
    one), then runs the epochs (`run_epochs`) with Keras's announcing
    callbacks silent on processes other than 0.
    """
    # Process 0 writes the callbacks' files; with a state split across
    # processes, every process takes part in their reads of the model.
    callbacks = callbacks_lib.callback_list(
        callbacks, trainer.model, verbose, epochs=epochs, steps=batches.steps,
        collective_reads=trainer.hosts.reads_collectively)
    feed = trainer.use_feed(batches, plan)  # first: its data takes memory
    with callbacks_lib.announced_on_process_0(callbacks):
        return run_epochs(trainer, batches, val, callbacks, epochs=epochs, resume=resume,
                          validation_freq=validation_freq, feed=feed, checkpoints=checkpoints,
                          profile_dir=profile_dir, peak_flops_per_s=peak_flops_per_s)


def run_epochs(trainer, batches, val, callbacks, *, epochs, resume, validation_freq, feed,
               checkpoints=None, profile_dir=None, peak_flops_per_s=None):
    """Train from `resume` to epoch `epochs - 1` with `callbacks` (a `CallbackList`).

    `resume` (a `Position`) is the epoch to start at and how many of its
    steps a restored checkpoint has done already; a
    `keras.callbacks.BackupAndRestore` that restores a backup in
    `on_train_begin` moves the start, as under `model.fit`. `feed` brings
    the batches to the steps (`feed.HostFeed` or `feed.ResidentFeed`, as
    `feed.make_feed` chose; its programs are compiled ahead where the
    epoch's plan is known, `programs.CompilingFeed`, and with them, during
    the first epoch, the validation's, if any epoch validates). Each
    epoch's `EpochTimer.result()` is appended to `trainer.timings`, emptied
    first; `profile_dir` traces a few calls of the first epoch. Whatever
    ends the loop (an exception, Ctrl-C), the model holds the last step's
    state when this returns or raises, a step that failed at run time
    included when the steps keep their input (`trainer.keeps_last_good`);
    if it was donated, the model holds the last one written back, as the
    exception's note says (`LiveModel.report`). Then, as at the end of `model.fit` (in its
    `finally`, failed or not), the optimizer's `finalize_variable_values`
    runs: with `use_ema`, the moving averages replace the weights, each
    variable keeping a buffer of its own (`state.finalize_variable_values`).

    A run that stops early (`stop_training`) marks its checkpoint stopped,
    and saves it once more after `on_train_end` (even if a callback raises
    there), so that it holds what the model ends with (`EarlyStopping`'s
    best weights); a `resume` from it (`resume.stopped`) trains nothing.
    """
    model = trainer.model
    model.stop_training = False
    last = resume.epoch if resume.stopped else epochs  # a stopped run trains nothing
    validation = _validation_programs(trainer, val, range(resume.epoch, last), validation_freq)
    feed = programs_lib.CompilingFeed(
        feed, batches, layout=trainer.layout, steps_per_execution=trainer.steps_per_execution,
        unroll=trainer.unroll, ahead=trainer.hosts.compiles_ahead, validation=validation)
    run = FitRun(trainer, batches, LiveModel(model, trainer.hosts.before_gather), callbacks,
                 feed, checkpoints, validation=validation, peak_flops_per_s=peak_flops_per_s)
    run.profile = _profile(profile_dir)
    trainer.timings = []
    epoch_logs, finished, stopped = {}, False, None
    callbacks.on_train_begin()
    start = _compat.take_initial_epoch(model) or resume.epoch
    try:
        if checkpoints is not None or callbacks_lib.restores(callbacks):
            run.hosts.same_start(start, resume.steps if start == resume.epoch else 0)
        with run.live.attached(), run.hosts.preemption(
                saving=checkpoints is not None) as preemption:
            run.preemption = preemption
            for epoch in range(start, last):
                validate_now = val is not None and options.should_validate(
                    epoch, validation_freq)
                skip = resume.steps if epoch == resume.epoch else 0
                epoch_logs = run_epoch(run, epoch, skip, val if validate_now else None)
                stop = stops_after(run, epoch, epochs)
                end = Position(epoch + 1, 0, stopped=bool(stop))
                stopped = end if stop else None
                end_at(run, end)
                if stop:
                    break
        if run.live.lost is not None:  # never silently: a state left unwritten
            raise RuntimeError(run.live.report())
        finished = True
    except BaseException as error:
        # A FloatingPointError says what the model holds itself; SystemExit
        # follows a checkpoint's own message.
        if not isinstance(error, (FloatingPointError, SystemExit)):
            error.add_note(run.live.report())
        _compat.shut_down_callback_pool(callbacks)  # on_train_end will not run
        raise
    finally:
        feed.close()  # no compile ahead for a fit that has ended
        batches.close()  # a stream's open pass, and the threads reading it
        if run.profile is not None:
            run.profile.close()
        if epochs > 0 and not resume.stopped:  # a stopped run's checkpoint holds the end
            # Keras's own end of fit: e.g. copy EMA weights into the model.
            state_lib.finalize_variable_values(model)
        if checkpoints is not None and not finished:
            checkpoints.close()
    if finished:
        try:
            callbacks.on_train_end(epoch_logs)
        finally:  # also when a later callback's on_train_end raises
            if checkpoints is not None and stopped is not None:
                # What the run ends with (EarlyStopping's best weights) is what a rerun gets.
                checkpoints.save(trainer.init_state(), stopped, trainer.seed)
    if checkpoints is not None:
        checkpoints.close()
    return model.history


def _profile(profile_dir):
    """The `timing.Profile` of `profile_dir` (`~` expanded, made now), or None.

    Made before any step: a path that cannot be a directory fails here, not
    in `jax.profiler.start_trace` after the first call.
    """
    if profile_dir is None:
        return None
    directory = options.check_dir(profile_dir, "profile_dir")
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as error:
        reason = ("it exists and is not a directory" if os.path.exists(directory)
                  else error.strerror or str(error))
        raise ValueError(
            "`profile_dir` must be a directory keras_dp can create and write to: "
            f"{directory} {reason}. Received: profile_dir={profile_dir!r}. "
            "Pass a directory's path."
        ) from None
    return Profile(directory)


def _validation_programs(trainer, val, epochs, validation_freq):
    """The `programs.EvalPrograms` of `val` if one of `epochs` validates, else None."""
    if val is None or not options.validations(epochs, validation_freq):
        return None
    return programs_lib.EvalPrograms(trainer.programs, val, layout=trainer.layout,
                                     steps_per_execution=trainer.steps_per_execution,
                                     ahead=trainer.hosts.compiles_ahead)


def stops_after(run, epoch, epochs):
    """Whether training stops after `epoch` (`stop_training`, a stream run dry).

    Across processes they decide together, in one round, unless `epoch` is
    the last anyway and no checkpoint is kept (whose `stopped` mark they
    share): a callback that stops one process (an `EarlyStopping` on a
    value of its own) stops all, where the others would wait for it in the
    next step for ever.
    """
    stop = run.model.stop_training or run.batches.exhausted
    if epoch + 1 < epochs or run.checkpoints is not None:
        stop = run.hosts.stop_together(run.model, stop)
    return stop


def run_epoch(run, epoch, skip, val):
    """One epoch: start, train, validate, end callbacks. Returns the epoch logs.

    `skip` steps of the epoch are done already (a restored checkpoint, whose
    metrics hold their running totals).
    """
    run.timer = EpochTimer(epoch, run.peak_flops_per_s)
    start_epoch(run, epoch, skip)
    logs = train_batches(run, epoch, skip)
    # No logs: a one-shot stream ran dry at the epoch's start (fit stops).
    epoch_logs = {} if logs is None else callbacks_lib.to_python(
        logs, run.model, run.live.state.metrics)
    # As Keras's fit does at each epoch's end, the model gets the state
    # before validation and `on_epoch_end`, whether the callbacks look
    # through `self.model` or not (a LambdaCallback's closure over the
    # model), and what they change is read before the next step
    # (`LiveModel`). Keras's History and progress bar read only the logs:
    # with no other callback, the state is written back at the fit's end.
    user_callbacks = callbacks_lib.beyond_logs(run.callbacks)
    if user_callbacks:
        run.live.sync()
    run.timer.lap("other_s")
    if val is not None and logs is not None:
        epoch_logs.update(validate(run, val))  # syncs again before on_test_end
        run.timer.lap("validation_s")
    run.callbacks.on_epoch_end(epoch, epoch_logs)
    run.timer.lap("callbacks_s")
    run.trainer.timings.append(run.timer.result(run.feed.flops))
    return epoch_logs


def start_epoch(run, epoch, skip):
    """Reset the metrics, call `on_epoch_begin`, and bring the state in.

    The state stays on the devices from epoch to epoch unless a callback
    changed the model (weights, learning rate) since they met; a change of
    a layer's `trainable` is refused. Across processes, reading the model
    is a broadcast of process 0's in which every process takes part, so
    they decide together (one host round trip): if any process's callbacks
    changed its model, every process reads process 0's.
    """
    trainer, live = run.trainer, run.live
    if not skip:
        run.model.reset_metrics()
    run.timer.lap("other_s")
    run.callbacks.on_epoch_begin(epoch)
    run.timer.lap("callbacks_s")
    # A layer's `trainable` set by a callback during the fit is refused here
    # (or at the read of a model a callback changed), before the next step.
    model_checks.check_trainable_unchanged(run.model)
    needs_read = run.hosts.any_reads(live.needs_read(), live.sync)
    if needs_read:
        live.read(trainer.init_state(), (epoch, skip))
    elif not skip:  # reset above, as Keras resets them once an epoch
        live.state = live.state._replace(metrics=state_lib.fresh_metrics(
            run.model, trainer.mesh, trainer.state_layout().metrics, reset=False))
    run.timer.lap("other_s")


def train_batches(run, epoch, skip):
    """Run the epoch's steps; return the last step's logs (None if no step ran).

    Keeps at most `steps_in_flight` calls unfinished, checks each call's
    loss when it finishes, and stops early on `stop_training`. The batch
    hooks, `stop_training` and SIGTERM come once per K steps, as under
    `model.fit` (`Cadence`). Counts the time waiting for input, in steps
    and in callbacks (`run.timer`); starts and stops the profile.

    Raises:
        FloatingPointError: a step's loss was NaN or Inf (unless a callback
            such as `TerminateOnNaN` stopped training instead).
    """
    throttle = Throttle(run.trainer.steps_in_flight)
    cadence = Cadence(run.trainer.steps_per_execution, skip)
    placed = run.feed.epoch(epoch, skip)
    index, logs, timer = skip, None, run.timer
    # Closing it on a break (stop_training) stops the look-ahead thread now.
    with contextlib.closing(placed):
        for calls, (steps, device_batch) in enumerate(placed, 1):
            timer.lap("input_s")
            if cadence.begins(index):
                if run.preemption is not None and run.preemption.requested:
                    throttle.drain()
                    end_at(run, Position(epoch, index))
                run.callbacks.on_train_batch_begin(index)
                timer.lap("callbacks_s")
            logs = train_call(run, steps, device_batch, throttle, (epoch, index))
            if run.profile is not None:
                run.profile.after_call(calls, logs)
            timer.lap("steps_s")
            index += steps
            timer.samples += steps * device_batch.rows
            end = cadence.ends(index) if throttle.failure is None else cadence.close()
            if end is not None:
                run.callbacks.on_train_batch_end(end, logs)
                timer.lap("callbacks_s")
            if throttle.failure is not None or (end is not None and run.model.stop_training):
                if throttle.failure is None:  # every process's stop, or a clear error
                    run.hosts.stop_mid_epoch(placed, epoch, index - 1)
                break
        timer.lap("input_s")  # the wait that found the epoch's end
    end = cadence.close()  # the group the data ended in
    if end is not None:
        run.callbacks.on_train_batch_end(end, logs)
        timer.lap("callbacks_s")
    throttle.drain()
    timer.lap("steps_s")
    if run.profile is not None:
        run.profile.close()  # the first epoch only
    if throttle.failure is not None and not run.model.stop_training:
        raise FloatingPointError(failure_message(epoch, *throttle.failure))
    return logs


def train_call(run, steps, device_batch, throttle, at):
    """Dispatch one compiled call of `steps` steps at `at` (epoch, index); return its logs.

    The new state is recorded before Ctrl-C can interrupt (`LiveModel.advance`).
    """
    trainer, live = run.trainer, run.live
    (epoch, index) = at
    if live.needs_read():  # a callback changed the model
        live.read(trainer.init_state(), at)
    try:
        logs, finite = live.advance(
            lambda state: run.feed.call(state, steps, device_batch), (epoch, index + steps))
    except Exception as error:  # told as the user's mistake where keras_dp knows it
        explained = explain.call_failure(error, trainer.model, run.batches.peek, steps,
                                         device_batch, at)
        if explained is error:
            raise
        raise explained from None
    throttle.add((index, finite, logs))
    return logs


def validate(run, val):
    """Score the validation data with the live weights: `val_*` logs.

    As under `model.fit`, the non-trainable values the test steps leave (a
    seed generator advanced in inference mode) carry into the next epoch,
    and what a callback changed in the model is honoured: at the last
    batch's end it is scored and trained on; in `on_test_begin` it is
    scored (`SwapEMAWeights` swaps the moving averages in), and what
    `on_test_end` leaves (the averages swapped out, a changed BatchNorm
    statistic) is trained on: the model gets the test steps' values before
    `on_test_end`, as Keras's evaluate gives them.
    """
    live, read = run.live, run.trainer.init_state

    def tested(non_trainable, metrics):
        live.tested(read, non_trainable, metrics, hosts=run.hosts,
                    model_read=callbacks_lib.beyond_logs(run.callbacks))

    logs = inference.evaluate(
        run.trainer, lambda: live.current(read, run.hosts).weights, val, run.callbacks,
        tested, run.validation)
    return {f"val_{name}": value for name, value in logs.items()}


def end_at(run, position):
    """Save a checkpoint at `position` (with a checkpoint_dir); exit with 143 if SIGTERM asked to.

    At an epoch's end, and at the step boundary where SIGTERM was found:
    `requested`, once true, stays true, so reading it again there makes
    no new sync point across processes.
    """
    if run.checkpoints is not None:
        run.checkpoints.save_live(run.live, run.trainer, position)
    if run.preemption is not None and run.preemption.requested:
        directory = None if run.checkpoints is None else run.checkpoints.directory
        run.preemption.exit(directory, position)


# The parts of an epoch's time (`EpochTimer`), beside `other_s`.
PARTS = ("input_s", "steps_s", "callbacks_s", "validation_s")


class EpochTimer:
    """The seconds of one epoch, by part.

    The loop marks the end of each part (`lap`) with `time.perf_counter`
    at points where it passes anyway, so timing adds no device
    synchronisation, and the parts add up to the epoch's wall time:
    `input_s` (waiting for the next batch or stack, its copy to the devices
    included), `steps_s` (dispatching calls and waiting on the bound of
    steps in flight, the first call's compile included), `callbacks_s`
    (their hooks, and writing the state back when one looks),
    `validation_s`, and `other_s` (resetting metrics, reading the model,
    the logs to Python floats). The FLOPs of the epoch's training calls
    (`programs.CompilingFeed.flops`, all devices) over its training time
    (without validation) give its FLOP/s, and against the devices' peak,
    the fraction of peak.

    Started when made; `lap(name)` counts the time since the previous lap
    (or the start) towards part `name`; `samples` counts the rows trained on.
    """

    def __init__(self, epoch, peak_flops_per_s=None):
        self.epoch = epoch
        self.peak_flops_per_s = peak_flops_per_s
        self.samples = 0
        self.seconds = dict.fromkeys(PARTS + ("other_s",), 0.0)
        self._start = self._last = time.perf_counter()

    def lap(self, name):
        """End a part: the seconds since the previous lap go to `name`."""
        now = time.perf_counter()
        self.seconds[name] += now - self._last
        self._last = now

    def result(self, flops=None):
        """The epoch's breakdown: a dict of seconds, samples, FLOPs and rates.

        Keys: `epoch`, `wall_s` (from the start of the epoch to now, the
        end of its `on_epoch_end` callbacks), the parts of `PARTS` and
        `other_s` (which add up to `wall_s`: the time since the last lap
        goes to `other_s`), `samples`, and `samples_per_s`: the samples
        over the epoch's training time, its wall time without validation.
        `flops` (the epoch's training FLOPs, all devices; None if unknown),
        `flops_per_s` (over the same training time), `peak_flops_per_s`
        (all devices, None where `PEAK_FLOPS` does not know them) and
        `fraction_of_peak` (None unless both are known).
        """
        self.lap("other_s")
        wall = self._last - self._start
        training = wall - self.seconds["validation_s"]
        rate = None if flops is None or training <= 0 else flops / training
        peak = self.peak_flops_per_s
        return {
            "epoch": self.epoch, "wall_s": wall, **self.seconds, "samples": self.samples,
            "samples_per_s": self.samples / training if training > 0 else 0.0,
            "flops": flops, "flops_per_s": rate, "peak_flops_per_s": peak,
            "fraction_of_peak": None if rate is None or peak is None else rate / peak,
        }


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
