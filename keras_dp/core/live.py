"""The fit in progress: its live state, the Keras model's view of it, Ctrl-C and steps in flight.

`LiveModel` holds the state of the epoch in progress and keeps the Keras
model in step with it whenever a callback looks. `Deferred` holds Ctrl-C
back while the state changes hands. `Throttle` bounds the dispatched but
unfinished calls and checks each one's loss when it retires; `LastGood`
keeps the newest state known to have completed, for when a later step
fails at run time. `Position` names a point in a fit.
"""

import collections
import contextlib
import dataclasses
import signal
import threading

import jax
import numpy as np

from keras_dp import _compat
from keras_dp.core.state import TrainState
from keras_dp.core.state import is_alive
from keras_dp.core.state import write_back


@dataclasses.dataclass(frozen=True)
class Position:
    """Where a run stands: `steps` steps of epoch `epoch` (0-based) are done.

    `stopped`: `stop_training` ended the run there (a callback such as
    `EarlyStopping`, or a stream run dry); a rerun trains nothing.
    """

    epoch: int
    steps: int
    stopped: bool = False

    def at(self):
        """Where, in words: "at the end of epoch 2", "after 5 steps of epoch 3" (from 1)."""
        if self.steps == 0:
            return f"at the end of epoch {self.epoch}"
        return f"after {self.steps} steps of epoch {self.epoch + 1}"


class LiveModel:
    """The state of the epoch in progress, and the Keras model's view of it.

    While `attached`, the model's `jax_state_sync` is this object's `sync`.
    Keras's `Callback.model` calls it on the JAX backend before handing the
    model to a callback, so a callback that reads `self.model` mid-epoch gets
    the current weights; before the next step, `needs_read` then compares
    the model's arrays with those last exchanged (`touched`) and has the
    model read only if one changed, so that what a callback changed is
    trained on. A step costs no copy unless a callback looks.

    The state and the model are each labelled with their position, `(epoch,
    steps done in it)`: `position` for the live state, `model_position` for
    what the model holds (None until the first read). When the steps do not
    donate their state (`keep_last_good`), the newest state known to have
    completed is kept too (`LastGood`), and written back if a later
    step fails at run time.
    """

    def __init__(self, model, before_gather=None):
        self.model = model
        # Across processes with a split state: `before_gather(position)`, a
        # round that every process reading the model makes before the gather.
        self._before_gather = before_gather
        self._ungathered = None  # why the split state cannot be gathered here, if so
        self.state = None
        self.synced = True  # the model holds what `state` holds
        self.touched = False  # a callback has seen the model since the last read
        self.position = self.model_position = None
        self.lost = None  # why the live state could not be written back, if so
        self.kept = False  # the model got the last good state instead (`finish`)
        self._last_good = LastGood()
        self._exchanged = []  # the model's arrays when it last met `state`
        self._variables = None  # the model's variables `state` was read from (`read`)
        self._compiled = None  # the model's optimizer, loss and metrics at `read`
        self._interrupts = Deferred()

    @contextlib.contextmanager
    def attached(self):
        """The span of a fit: the model's sync hook calls `sync`, SIGINT waits for hand-overs.

        Leaving the block, by any exit, writes the state back (`finish`)
        before SIGINT gets its usual handler again.
        """
        _compat.shadow_state_sync(self.model, self.sync)
        try:
            with self._interrupts:
                try:
                    yield self
                finally:
                    self.finish()
        finally:
            _compat.unshadow_state_sync(self.model)

    def read(self, state, position):
        """Take `state`, just read from the model (which is at `position`), as the live state.

        The variables it was read from are kept: `state` is written back
        into them even if a layer's `trainable` moves one to another group.
        """
        self._variables = self._state_variables()
        self._compiled = self._compiled_parts()
        self.state, self.synced, self.touched = state, True, False
        self.position = self.model_position = position
        self._exchanged = self._arrays()
        self._last_good.reset(state, position)

    def needs_read(self):
        """Whether the model must be read again before the next step.

        True when there is no live state, or when a callback has seen the
        model and changed one of its weights, non-trainable or optimizer
        variables since they last met the state (Keras's `assign` puts a
        new array in the variable, so comparing arrays by identity finds
        any change without a copy). A callback that only looked costs no
        read. Metric variables are not compared: the trainer resets them
        itself.
        """
        if self.state is None:
            return True
        changed = self.model_changed()
        self.touched = False
        return changed

    def model_changed(self):
        """Whether a callback changed the model since it met the state (`needs_read`, read only).

        A `model.compile` in a callback counts as a change: the read that
        follows refuses it (`ShardedTrainer.init_state`), at the next step.
        """
        return self.touched and (
            any(now is not then for now, then in zip(self._compiled_parts(), self._compiled))
            or any(now is not then for now, then in zip(self._arrays(), self._exchanged)))

    def _compiled_parts(self):
        """The objects `model.compile` replaces: the optimizer, compiled loss and metrics."""
        return (getattr(self.model, "optimizer", None), _compat.compiled_loss(self.model),
                _compat.compiled_metrics(self.model))

    def current(self, read, hosts):
        """The state the run is at: the live state, or the model's if a callback changed it.

        Writes nothing into the model, so a split state stays split. When a
        callback has changed the model since it met the state, the model is
        the truth: `read()` (the trainer's `init_state`) lays it out on the
        mesh, and it becomes the live state. Across processes every process
        reads when any one must (`hosts.any_reads`), as at an epoch's start,
        since reading is collective.
        """
        if hosts.any_reads(self.model_changed(), self.sync):
            self.read(read(), self.position)
        return self.state

    def _arrays(self):
        # Metric variables are left out: the trainer resets them itself.
        return [variable.value for variable in self._compared_variables()]

    def _compared_variables(self):
        """The variables whose change makes `needs_read` true."""
        variables = TrainState.variables_of(self.model)._replace(metrics=[])
        return [variable for group in variables for variable in group]

    def _state_variables(self):
        """The model's variables, as the groups of a state read from it now."""
        return TrainState(*map(list, TrainState.variables_of(self.model)))

    def _write(self, state):
        """Write `state` into the model (an ensemble writes every member)."""
        write_back(state, self.model, self._variables)

    def advance(self, call, position):
        """Run `call(state) -> (new_state, *rest)` on the live state; return `rest`.

        `call` may donate the live state, so its successor, at `position`,
        is recorded before a KeyboardInterrupt can be raised: SIGINT is held
        back from the call until the new state is stored. If `call` raises,
        the live state stays what it was (deleted if the call donated it).
        """
        with self._interrupts.held():
            self._last_good.confirm()  # drop what is no longer the last good, first
            given = self.state
            try:
                new_state, *rest = call(given)
            finally:  # failed or not, a call that donated left nothing to keep
                # A call donates all of its state or none of it: one leaf tells.
                if jax.tree.leaves(given)[0].is_deleted():
                    self._last_good.stop()
            self.stepped(new_state, position)
        return rest

    def stepped(self, state, position=None):
        """Take a step's new state (at `position`, default: unchanged); the model is behind it."""
        self.state, self.synced = state, False
        if position is not None:
            self.position = position
        self._last_good.dispatched(state, self.position)

    def tested(self, read, non_trainable, metrics, *, model_read, hosts):
        """Take the non-trainable and metric values a validation's test steps left.

        As after `model.fit`'s validation: they carry into the next epoch
        (a seed generator advanced in inference mode), and the metrics hold
        the validation's results until the epoch after resets them. The
        weights are the run's (`current(read, hosts)`). With
        `model_read` (a callback may read the model, through `self.model` or
        a closure), they are written into the model now: called before
        `on_test_end`, as Keras's evaluate gives them to the model, so that
        what a callback changes there is what the next epoch trains on.
        """
        self.stepped(self.current(read, hosts)._replace(non_trainable=non_trainable,
                                                              metrics=metrics))
        if model_read:
            self.sync()

    def sync(self):
        """Write the live state into the model if it is behind (Keras calls this).

        With `before_gather`, every process agrees first; if that fails,
        the state is not gathered by this process alone, now or at `finish`.
        """
        self.touched = True
        if not self.synced and self._before_gather is not None:
            try:
                self._before_gather(self.position)
            except BaseException:
                self._ungathered = ("the training state is split across processes and "
                                    "could not be gathered on this process alone")
                raise
        self.finish()

    def finish(self):
        """Write the state into the model if it is behind and known good; else say why not.

        Never when the model is in step: a callback may have changed it
        after the last step (ReduceLROnPlateau at the last epoch's end). A
        state that was donated to a step that then failed, or that holds a
        failed step's result, is not written: `lost` says which. The model
        then gets the last state that completed if the steps kept it
        (`kept`), else keeps what it held (`model_position` says which).
        """
        if self.synced:
            return
        if self._ungathered is not None:  # a collective of this process alone: never
            self.lost = self._ungathered
            return
        with self._interrupts.held():
            self.lost = _unusable(self.state)
            if self.lost is None:
                self._give_model(self.state, self.position)
                self.synced = True
                self._last_good.reset(self.state, self.position)
                return
            state, position = self._last_good.confirm(wait=True)
            if state is not None:
                self._give_model(state, position)
                self.kept = True
                self._last_good.stop()  # written once: nothing more to keep

    def _give_model(self, state, position):
        """Write `state`, at `position`, into the model and note what the model now holds."""
        self._write(state)
        self.model_position = position
        self._exchanged = self._arrays()

    def report(self):
        """A sentence for an error that ends fit: which step's weights the model holds."""
        if self.model_position is None:
            return "keras_dp: the model holds the weights it had before fit."
        epoch, steps = self.model_position
        held = f"the weights after {steps} steps of epoch {epoch + 1}"
        if self.lost is None or self.position == self.model_position:
            return f"keras_dp: the model holds {held}, the last step that completed."
        at_epoch, at_steps = self.position
        if self.kept:
            return (
                f"keras_dp: {self.lost}, so the model holds {held}, the last step "
                f"that completed; no completed step is lost (the steps after it, up "
                f"to {at_steps} steps of epoch {at_epoch + 1}, did not complete)."
            )
        return (
            f"keras_dp: {self.lost}, so the model holds {held}, the last state "
            f"written back to it; the steps completed after it, up to {at_steps} "
            f"steps of epoch {at_epoch + 1}, are lost."
        )


def _unusable(state):
    """Why `state` cannot be written back (donated, or a failed step's result), or None."""
    if not is_alive(state):
        return "the step that failed had consumed its input state (donated to it)"
    try:
        jax.block_until_ready(state)
    except Exception as error:  # noqa: BLE001 - any failure of the step that made it
        return f"the step that made the state failed ({type(error).__name__})"
    return None


class Deferred:
    """SIGINT, run at once outside `held()` blocks and at their end inside them.

    A compiled step consumes (donates) the state it is given and returns
    its successor. Python runs a signal handler between any two bytecodes,
    so a `KeyboardInterrupt` raised by the default handler can land after
    the call returned and before its result was stored: the old state is
    gone and the new one is dropped with the frame that held it. While this
    is entered (for the whole of `fit`), SIGINT runs its handler, which
    calls the previous handler (Python's: raise `KeyboardInterrupt`) at
    once, except inside a `held()` block: there it only notes the signal,
    and the previous handler runs when the block ends, after the new state
    is recorded. A hand-over is one step's dispatch (on the first call, its
    compilation too), so Ctrl-C waits at most that long; a checkpoint being
    written is held too, until it is complete.

    Outside the main thread, or when SIGINT's handler is not a Python
    function (ignored, or the system default), entering changes nothing and
    `held()` holds nothing back.
    """

    def __init__(self):
        self._previous = None
        self._depth = 0
        self._pending = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGINT)
            if callable(previous):
                self._previous = previous
                signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc_info):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    @contextlib.contextmanager
    def held(self):
        """A block that SIGINT does not interrupt; a signal that came runs at its end."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth and self._pending is not None:
                pending, self._pending = self._pending, None
                self._previous(*pending)  # Python's default raises KeyboardInterrupt

    def _handle(self, signum, frame):
        if self._depth:
            self._pending = (signum, frame)
        else:
            self._previous(signum, frame)


class Throttle:
    """Bounds how many dispatched steps may still be running.

    JAX dispatches a step and returns at once; on XLA:CPU, several queued
    steps with cross-device all-reduces can deadlock its thread pool, so
    the bound there is 1 (`keras_dp.options.steps_in_flight`).

    Items are `(first_step, finite_steps, logs)` for a train call of one or
    more steps, `finite_steps` counting its steps with a finite loss, or an
    evaluation's bare logs (nothing to check: only waited for). When an item
    is finished, its loss is checked: `failure` becomes `(step, loss)` for
    the first step whose running loss is NaN or Inf. Checking only finished
    steps costs no extra wait.
    """

    def __init__(self, limit):
        self._limit = limit
        self._pending = collections.deque()
        self.failure = None

    def add(self, item):
        """Track a dispatched call; wait for the oldest while over the limit."""
        self._pending.append(item)
        while len(self._pending) >= self._limit:
            self._retire()

    def drain(self):
        """Wait for (and check) every tracked call."""
        while self._pending:
            self._retire()

    def _retire(self):
        item = jax.block_until_ready(self._pending.popleft())
        if not isinstance(item, tuple):
            return
        first_step, finite, logs = item
        if self.failure is None and "loss" in logs:
            loss = np.asarray(logs["loss"])  # one value, or several from a model's own step
            if not np.all(np.isfinite(loss)):
                self.failure = (first_step + int(finite), loss.tolist())


class LastGood:
    """The newest of a fit's states known to have completed, and those not known yet.

    Each dispatched state is pending until it is known to have completed.
    `confirm` promotes the pending states that are ready, oldest first,
    without waiting: the `Throttle` has waited for every call but the
    newest `steps_in_flight - 1`, so those it retired are ready. It stops at
    the first state not ready, or failed. So while a call is dispatched,
    the states held are those of the calls in flight plus the last good
    one: `steps_in_flight + 1` at most. A state read from, or written into,
    the model is good at once (`reset`). Once a call has donated its input
    (`stop`), no earlier state exists to keep, and tracking stops.

    Attributes:
        state, position: the last good state and its `(epoch, steps)`, or None.
    """

    def __init__(self):
        self.state = self.position = None
        self._pending = collections.deque()
        self._tracking = True

    def reset(self, state, position):
        """Take `state`, at `position`, as good; forget the pending states before it."""
        self._pending.clear()
        if self._tracking:
            self.state, self.position = state, position

    def dispatched(self, state, position):
        """Track `state`, the result of a call dispatched just now, at `position`."""
        if self._tracking:
            self._pending.append((state, position))

    def stop(self):
        """Keep no more states: a call consumed its input (none before it survives)."""
        self._tracking = False
        self.state = self.position = None
        self._pending.clear()

    def confirm(self, wait=False):
        """Promote the pending states that completed; with `wait`, wait for each first.

        Returns `(state, position)`, the last good. A pending state that
        failed (its arrays raise the step's error) is dropped with every
        one after it, since each of those was computed from it.
        """
        while self._pending:
            state, position = self._pending[0]
            leaves = jax.tree.leaves(state)
            # The outputs of a call are ready together: its first one tells,
            # at a fraction of the cost of asking each.
            if not wait and not leaves[0].is_ready():
                break
            try:
                jax.block_until_ready(leaves)  # no wait: ready, unless `wait`
            except Exception:  # noqa: BLE001 - the step's error, raised where it is awaited
                self._pending.clear()
                break
            self._pending.popleft()
            self.state, self.position = state, position
        return self.state, self.position


# What to check after a non-finite step, for one model or an ensemble's members.
ADVICE = (
    "Check that batch for NaN or Inf inputs, labels or sample weights; a finite loss "
    "with non-finite gradients comes from an op whose gradient is "
    "infinite at some input (sqrt or log at 0, a division by 0). Else "
    "lower the learning rate, or clip gradients (for example optimizer "
    "clipnorm=1.0); add keras.callbacks.TerminateOnNaN() to stop without "
    "an error."
)


def failure_message(epoch, step, loss):
    """The error for the first step, batch `step` of (0-based) `epoch`, with non-finite values.

    The compiled step (`finite.keep_if_not_finite`) did not apply that step
    or any after it in the epoch, so the model holds the weights after
    `step` steps of the epoch.
    """
    return (
        f"The training values became {loss} at epoch {epoch + 1}, batch {step} "
        "(counted from 0 within the epoch, as callbacks count): that step's "
        "loss, or the weight update from its gradients, was NaN or Inf. It "
        "was not applied, nor any step after it, and training stopped: the "
        f"model holds the weights after {step} steps of epoch {epoch + 1}. "
        + ADVICE
    )
