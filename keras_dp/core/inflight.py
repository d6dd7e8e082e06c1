"""A bound on dispatched but unfinished steps, the check of their loss, the last good state.

JAX dispatches a step and returns at once. On XLA:CPU, several queued steps
with cross-device all-reduces can deadlock its thread pool (measured: about
half of the runs with 2 or 8 simulated devices hung), so the trainer keeps
at most 1 step in flight there, 2 elsewhere. Each step is checked for a
non-finite loss when it is retired, which costs no extra wait (the step
makes its loss NaN after a non-finite update too: `finite.keep_if_not_finite`).
When the steps do not donate their state, `LastGood` keeps the newest state
known to have completed, for when a later step fails at run time.
"""

import collections

import jax
import numpy as np


class Throttle:
    """Bounds how many dispatched steps may still be running.

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


def bound(steps_in_flight, on_cpu):
    """The bound on unfinished steps: the argument, else 1 on CPU and 2 elsewhere."""
    if steps_in_flight is None:
        return 1 if on_cpu else 2
    if isinstance(steps_in_flight, bool) or not isinstance(steps_in_flight, int) \
            or steps_in_flight < 1:
        raise ValueError(
            "`steps_in_flight` is how many dispatched steps may be unfinished "
            "at once, an int of at least 1 (None: 1 on CPU, 2 elsewhere). "
            f"Received: steps_in_flight={steps_in_flight!r}."
        )
    return steps_in_flight
