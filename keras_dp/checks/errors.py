"""Keras's and JAX's failures, told as the user's mistake and its fix.

A mistake in a user's model or data surfaces as an error from deep inside
Keras's layers or JAX's tracer, with dozens of frames of their code. These
helpers find the user's own frame in it and, for the failures keras_dp
knows, raise a `ValueError` that names what the user wrote, where, and what
to do instead, without the chain of internals: a tensor read in Python
(`raise_untraceable`), a layer that cannot be compiled (`jit_failure`),
a batch of other shapes than the first (`shape_change`).
"""

import re
import traceback

import jax
import numpy as np

from keras_dp import _compat
from keras_dp.checks import model as model_checks


def error_chain(error):
    """`error` and the errors it was raised from (`__cause__`, else `__context__`)."""
    chain = []
    while error is not None and all(error is not link for link in chain):
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


# Modules whose frames are not the user's code, when naming where a trace failed.
LIBRARIES = ("keras.", "keras_dp.", "jax.", "jaxlib.", "numpy.", "optree.")


def raise_untraceable(error, what):
    """Raise a `ValueError` for a JAX trace error in user code, naming where; else return.

    The `ValueError` replaces `error` (raised `from None`, without the chain
    of internals); without one, the caller goes on to handle `error`.

    A loss, metric or layer that reads a tensor's value in Python (numpy on
    a tensor, `float()`, an `if` on a value) fails JAX's trace with a
    `jax.errors.JAXTypeError` (`TracerArrayConversionError`,
    `ConcretizationTypeError`, ...). Keras's `model.fit` on JAX traces
    them too, even with `run_eagerly=True`, and fails on them alike.

    Args:
        error: the exception raised while tracing.
        what: the subject of the message (`"The loss, my_loss,"`).
    """
    chain = error_chain(error)
    reported = [link for link in chain if isinstance(link, jax.errors.JAXTypeError)]
    if not reported:
        return
    # Innermost last: Keras re-raises a layer's error with its own frames cut.
    frames = user_frames(error)
    if not frames:  # Keras's or JAX's own code: not this mistake
        return
    where = (f"{frames[-1].f_code.co_qualname}, line {frames[-1].f_lineno} of "
             f"{frames[-1].f_code.co_filename}")
    raise ValueError(
        f"{what} cannot be compiled: user code ({where}) reads a tensor's value in "
        "Python (numpy on a tensor, float() or int(), or an `if` on a value), "
        "which JAX cannot trace. keras_dp compiles its steps, as Keras's model.fit "
        "on JAX does even with run_eagerly=True (it fails on this too). Write it "
        "with keras.ops: keras.ops.mean for np.mean, keras.ops.where for a branch "
        f"on values. JAX reported: {first_line(reported[-1])}") from None


def call_failure(error, model, peek, steps, device_batch, at):
    """The error a compiled call that raised `error` should raise: `error`, or one naming the mistake.

    Told as the user's mistake where keras_dp knows it (each a `ValueError`
    that replaces `error`, raised `from None`): a layer that cannot be
    compiled (`jit_failure`), or a batch whose shapes differ from the first
    batch's (`shape_change`), in that order of asking. Anything else, and
    any error of a step that compiled and ran (`jax.errors.JaxRuntimeError`),
    is `error` itself. Called only when a call fails, so the calls that
    succeed never pass through here.

    Args:
        error: what the call raised.
        model: the Keras model.
        peek: returns the first host batch (called only here: reading it
            again can cost a shuffle of the whole epoch's order).
        steps: the call's steps (K stacked for more than 1).
        device_batch: the call's batch.
        at: the call's `(epoch, index)`.
    """
    error = jit_failure(error, model) or error
    return shape_change(error, peek, steps, device_batch, at) or error


def jit_failure(error, model):
    """A `ValueError` naming the `supports_jit=False` layers when a compiled step failed to trace; else None.

    Keras's `model.fit` runs a model with such a layer un-jitted; keras_dp
    always compiles its sharded step. Most such layers (RandomRotation,
    RandomTranslation, RandomZoom) trace fine; one that cannot (RandomCrop
    slices at traced offsets) fails here with the layer's name and the fix,
    instead of a trace error from deep inside JAX.
    """
    if isinstance(error, (FloatingPointError, jax.errors.JaxRuntimeError)):
        return None  # a step that compiled and ran (out of memory, a failed callback)
    layers = [layer for layer in _compat.all_layers(model)
              if not getattr(layer, "supports_jit", True)]
    if not layers:
        return None
    return ValueError(
        f"keras_dp compiles every step with jax.jit, and this model has layers "
        f"that set supports_jit=False: {model_checks.layer_names(layers)}. Keras's own "
        "model.fit runs such "
        "a model un-jitted; here the compiled step failed to trace: "
        f"{type(error).__name__}: {first_line(error)} Do that "
        "augmentation in the input pipeline instead (tf.data, or a "
        "keras.utils.PyDataset), or use a layer that compiles (for a crop: "
        "keras.layers.CenterCrop, or crop in the input pipeline)."
    )


def shape_change(error, peek, steps, device_batch, at):
    """A `ValueError` naming the batch when a compiled call failed on shapes unlike the first batch's; else None.

    `peek` returns the first host batch; `device_batch` is the call's (K
    stacked for `steps` > 1), `at` its `(epoch, index)`. The model's own
    check decides: batches of other shapes that it takes (a `None` length)
    train.
    """
    if isinstance(error, jax.errors.JaxRuntimeError):
        return None  # the step ran: not a matter of shapes
    changed = _changed_shapes(peek(), steps, device_batch)
    if changed is None:
        return None
    epoch, index = at
    return ValueError(
        f"Batch {index} of epoch {epoch + 1} (counted from 0 within the epoch) "
        f"has arrays of shapes {changed[1]} after the row dimension, where the "
        f"first batch had {changed[0]}, and the model cannot take them: "
        f"{type(error).__name__}: {first_line(error)} Give every batch the "
        "shapes the model was built for (with keras.Input, only dimensions "
        "given as None may vary)."
    )


def _changed_shapes(first, steps, device_batch):
    """`(first batch's, this call's)` shapes past the rows, or None if they agree."""
    data = getattr(device_batch, "data", None)  # resident rows have one shape
    if data is None:
        return None
    axes = 2 if steps > 1 else 1  # a K-step call's arrays are stacked
    now = [tuple(array.shape[axes:]) for array in jax.tree.leaves(data)]
    before = [tuple(np.shape(array)[1:]) for array in jax.tree.leaves(first)]
    return None if now == before else (before, now)


def first_line(error, limit=300):
    """The first line of `error` that says something, cut to `limit` characters.

    Without Keras's wrapping: its colour codes, and the "Exception
    encountered when calling ..." line it puts before a layer's own error.
    """
    text = str(error)
    if isinstance(error, KeyError) and len(error.args) == 1 and isinstance(error.args[0], str):
        text = error.args[0]  # str() of a KeyError is its repr, newlines escaped
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith("Exception encountered")]
    line = lines[0] if lines else type(error).__name__
    return line if len(line) <= limit else line[:limit] + " ..."


def user_frames(error):
    """The frames of `error`'s chain that are not Keras's, JAX's or keras_dp's code."""
    return [frame for link in error_chain(error)
            for frame, _ in traceback.walk_tb(link.__traceback__)
            if not frame.f_globals.get("__name__", "").startswith(LIBRARIES)]
