"""Keras's callbacks and logs, as `model.fit` hands them out.

`callback_list` makes the `keras.callbacks.CallbackList` `model.fit` would
(History, progress bar); the rest are Keras's rules for logs and for
`validation_freq`. The Keras model a callback reads is kept current by
`keras_dp.state.LiveModel`.
"""

import jax
import keras
import numpy as np

from keras_dp import distributed as distributed_lib


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
