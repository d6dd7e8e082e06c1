"""Every argument normalised and checked once: counts, switches, paths, steps."""

import numbers
import operator
import os

import keras


def check_count(name, value, minimum=None):
    """Return `value` as an int, or raise naming the argument `name`.

    Accepts what Python takes as an index (an int, a numpy integer), as
    Keras's loops do; a float such as `16.0` or a string is refused, not
    rounded, and so is a bool (`epochs=True` is a mistake, not 1).

    Raises:
        TypeError: `value` is not an integer.
        ValueError: `value` is below `minimum`.
    """
    try:
        if isinstance(value, bool):
            raise TypeError
        count = operator.index(value)
    except TypeError:
        raise TypeError(
            f"`{name}` must be an integer. Received: {name}={value!r} (of type "
            f"{type(value).__name__}). Pass an int; keras_dp does not round it."
        ) from None
    if minimum is not None and count < minimum:
        raise ValueError(f"`{name}` must be at least {minimum}. Received: {name}={value!r}.")
    return count


def check_auto(name, value):
    """`value` normalised: `"auto"`, `True` or `False` (`None` is `"auto"`), or raise naming `name`.

    Raises:
        ValueError: any other value.
    """
    if value is None or (isinstance(value, str) and value == "auto"):
        return "auto"
    if value is True or value is False:
        return value
    raise ValueError(
        f"`{name}` is 'auto' (the default, also None), True or False. "
        f"Received: {name}={value!r}."
    )


def steps_per_execution(model, value=None):
    """K, the steps per compiled call: `value`, else the model's from `compile`, else 1.

    Raises:
        ValueError: `value`, or the model's from `compile` when `value` is
            None, is not an int of at least 1.
    """
    received = f"steps_per_execution={value!r}"
    if value is None:
        value = getattr(model, "steps_per_execution", None)
        # Keras's compile stores any value; its fit then fails on 0 deep in its loop.
        received = f"model.compile(steps_per_execution={value!r})"
        value = 1 if value is None else value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(
            "`steps_per_execution` is the number of steps each compiled call "
            f"runs, an int of at least 1. Received: {received}."
        )
    return int(value)


def check_dir(value, argument):
    """`value`, a directory argument, as an absolute path with `~` expanded; None stays None.

    Raises:
        TypeError: `value` is not a str or `os.PathLike`.
        ValueError: `value` is empty (an unset variable, say), which would
            otherwise mean the working directory.
    """
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"`{argument}` must be a directory's path (a str or "
                        f"os.PathLike). Received: {argument}={value!r}.")
    if not os.fspath(value):
        raise ValueError(f"`{argument}` must name a directory; an empty path would be the "
                         f"working directory. Received: {argument}=''. Pass the "
                         "directory's path (\".\" for the working directory).")
    return os.path.abspath(os.path.expanduser(os.fspath(value)))


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


def validations(epochs, validation_freq):
    """How many of `epochs` (epoch indices) validate under `validation_freq`."""
    return sum(should_validate(epoch, validation_freq) for epoch in epochs)


def steps_in_flight(steps_in_flight, on_cpu):
    """The bound on unfinished steps: the argument, else 1 on CPU and 2 elsewhere.

    On XLA:CPU, several queued steps with cross-device all-reduces can
    deadlock its thread pool (measured: about half of the runs with 2 or 8
    simulated devices hung), so the default keeps 1 step in flight there.
    """
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


def data_on_device(data_on_device, whole_data=True):
    """`data_on_device` normalised: `"auto"`, `True` or `False` (`None` is `"auto"`).

    `whole_data`: whether this process holds all of the data (False on a
    mesh across processes, where each holds its share).

    Raises:
        ValueError: any other value, or `True` where this process holds a share only.
    """
    data_on_device = check_auto("data_on_device", data_on_device)
    if data_on_device is True and not whole_data:
        raise ValueError(
            "data_on_device=True keeps the whole dataset on every device, "
            "but this mesh spans processes and each holds only its share. "
            "Pass data_on_device='auto' or False."
        )
    return data_on_device


def check_one_restore(callbacks, checkpoint_dir):
    """Raise a `ValueError` if `checkpoint_dir` is given with a `BackupAndRestore`.

    Each restores a rerun from a point of its own: the checkpoint after the
    last step it saved (mid-epoch on SIGTERM), the backup at the start of
    the epoch it saved in, with the weights and optimizer it saved last
    (every N batches, or at an epoch's end). Together, a rerun took one's
    weights and the other's position: after a SIGTERM mid-epoch it skipped
    the steps the checkpoint had done from the backup's weights, and after
    a crash past a mid-epoch backup it trained that epoch's first batches
    twice.
    """
    if checkpoint_dir is None:
        return
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = callbacks.callbacks
    for index, callback in enumerate(keras.tree.flatten(callbacks or [])):
        if isinstance(callback, keras.callbacks.BackupAndRestore):
            raise ValueError(
                "checkpoint_dir and keras.callbacks.BackupAndRestore both restore a rerun "
                "of this fit, each from its own point (the checkpoint after the last step "
                "saved, the backup at the start of its epoch), so together a rerun would "
                "train some batches twice or skip others. Received: "
                f"checkpoint_dir={checkpoint_dir!r} and callbacks[{index}]=BackupAndRestore("
                f"backup_dir={callback.backup_dir!r}). Pass one: checkpoint_dir alone resumes "
                "exactly where the run stopped, mid-epoch too; BackupAndRestore alone "
                "restarts the epoch of its backup, as under model.fit."
            )


def unroll(value, steps_per_execution, on_cpu):
    """How many of a K-step call's steps to unroll per loop iteration of its scan.

    None: all K on CPU (where XLA runs a rolled loop of this kind slower),
    1 elsewhere; True unrolls all K and False none, as in `jax.lax.scan`.

    Raises:
        TypeError, ValueError: not an integer of at least 0 (`check_count`).
    """
    if value is None:
        value = steps_per_execution if on_cpu else 1
    elif isinstance(value, bool):  # as in jax.lax.scan: all K steps, or one
        value = steps_per_execution if value else 1
    return check_count("unroll", value, 0)
