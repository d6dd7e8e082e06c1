"""The bridge to Keras callbacks during `fit`.

`callback_list` makes the `keras.callbacks.CallbackList` `model.fit` would
(History, progress bar); `LiveModel` keeps the Keras model in step with the
device state whenever a callback looks at it; the rest are Keras's rules for
logs and for `validation_freq`.
"""

import contextlib

import jax
import keras
import numpy as np

from keras_dp import distributed as distributed_lib
from keras_dp.state import TrainState
from keras_dp.state import is_alive
from keras_dp.state import write_back


class LiveModel:
    """The state of the epoch in progress, and the Keras model's view of it.

    While `attached`, the model's `jax_state_sync` is this object's `sync`.
    Keras's `Callback.model` calls it on the JAX backend before handing the
    model to a callback, so a callback that reads `self.model` mid-epoch gets
    the current weights; `touched` then tells the trainer to read the model
    again before the next step, so that what the callback changed is trained
    on. A step costs no copy unless a callback looks.
    """

    def __init__(self, model):
        self.model = model
        self.state = None
        self.synced = True  # the model holds what `state` holds
        self.touched = False  # a callback has seen the model since the last read
        self._exchanged = []  # the model's arrays when it last met `state`

    @contextlib.contextmanager
    def attached(self):
        """While in this block, Keras's sync hook on the model calls `sync`."""
        self.model.jax_state_sync = self.sync  # shadows Keras's own, for this fit
        try:
            yield self
        finally:
            del self.model.jax_state_sync

    def read(self, state):
        """Take `state`, just read from the model, as the live state."""
        self.state, self.synced, self.touched = state, True, False
        self._exchanged = self._arrays()

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
        if not self.touched:
            return False
        self.touched = False
        return any(now is not then for now, then in zip(self._arrays(), self._exchanged))

    def _arrays(self):
        groups = TrainState.variables_of(self.model)
        return [variable.value for group in groups[:3] for variable in group]

    def stepped(self, state):
        """Take a step's new state; the model is now behind it."""
        self.state, self.synced = state, False

    def sync(self):
        """Write the live state into the model if it is behind (Keras calls this)."""
        self.touched = True
        if not self.synced:
            self.write_back_if_alive()

    def finish(self):
        """At the end of fit: write the state into the model if it is behind.

        Never when the model is in step: a callback may have changed it
        after the last step (ReduceLROnPlateau at the last epoch's end).
        """
        if not self.synced:
            self.write_back_if_alive()

    def write_back_if_alive(self):
        """Write the live state into the model unless it was donated away."""
        # A step that failed after its state was donated leaves nothing to
        # write; the model then keeps the weights of the last epoch boundary.
        if self.state is not None and is_alive(self.state):
            write_back(self.state, self.model)
            self.synced = True
            self._exchanged = self._arrays()


def callback_list(callbacks, model, verbose, **params):
    """The `CallbackList` `model.fit` would make: History, and a progress bar
    unless `verbose` is 0 (on process 0 only, across processes)."""
    if isinstance(callbacks, keras.callbacks.CallbackList):
        return callbacks
    verbose = 1 if verbose == "auto" else verbose
    if not distributed_lib.is_primary():
        verbose = 0  # one progress bar, on process 0, for all processes
    return keras.callbacks.CallbackList(
        callbacks, add_history=True, add_progbar=verbose != 0, model=model,
        verbose=verbose, **params,
    )



def to_python(logs):
    """Logs as python floats (arrays for non-scalar metrics), in the order
    `model.evaluate` lists them: the loss first, then the rest by name."""
    host = jax.device_get(logs)
    names = sorted(host, key=lambda name: (name != "loss", name))
    return {name: host[name].item() if np.ndim(host[name]) == 0 else np.asarray(host[name])
            for name in names}


def check_validation_freq(validation_freq):
    """Raise a `ValueError` unless `validation_freq` is an int >= 1 or a list."""
    if isinstance(validation_freq, bool) or not isinstance(validation_freq, (int, list, tuple)):
        raise ValueError(
            "`validation_freq` is an int (validate every that many epochs) or "
            f"a list of 1-based epochs. Received: {validation_freq!r}."
        )
    if isinstance(validation_freq, int) and validation_freq < 1:
        raise ValueError(f"`validation_freq` must be at least 1. Received: {validation_freq}.")


def should_validate(epoch, validation_freq):
    """Keras's rule: `validation_freq` counts epochs from 1."""
    if isinstance(validation_freq, int):
        return (epoch + 1) % validation_freq == 0
    return epoch + 1 in validation_freq
