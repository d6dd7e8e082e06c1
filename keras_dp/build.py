"""Building and compiling a Keras model from data, as `model.fit` does.

Keras builds an unbuilt model, its loss, metrics and optimizer from the
first batch; keras_dp does the same before anything is compiled for the
devices, and checks first that the labels fit the model's output, so that
a mistake fails with a message instead of deep inside a traced step.
"""

import jax
import keras
import numpy as np

from keras_dp import _compat


def compile_model(model, optimizer, loss, metrics):
    """Compile `model`, overriding only what is given (not None).

    A compiled model keeps its other compile arguments; an uncompiled one
    needs at least an optimizer and a loss.

    Raises:
        ValueError: no optimizer or no loss, from the model or the arguments.
    """
    overrides = {
        name: value
        for name, value in (("optimizer", optimizer), ("loss", loss), ("metrics", metrics))
        if value is not None
    }
    if not overrides and model.compiled:
        return
    # Recompile with the last compile()'s own objects, changing only what the
    # caller overrides (the public get_compile_config() serialises them, and
    # compiling from that would replace the user's optimizer and loss).
    config = _compat.compile_arguments(model) if model.compiled else {}
    config.update(overrides)
    if config.get("optimizer") is None or config.get("loss") is None:
        raise ValueError(
            "The model is not compiled, and keras_dp was not given both an "
            "optimizer and a loss. Either call model.compile(optimizer=..., "
            "loss=..., metrics=[...]) first, or pass optimizer= and loss= "
            f"(and metrics=). Received: optimizer={optimizer!r}, loss={loss!r}."
        )
    model.compile(**config)


def is_built(model):
    """Whether every layer, the optimizer, the loss and the metrics are built."""
    parts = (_compat.compiled_metrics(model), _compat.compiled_loss(model))
    return (
        all(layer.built for layer in _compat.all_layers(model))
        and model.optimizer.built
        and all(part is None or part.built for part in parts)
    )


def build(model, batch):
    """Build `model` symbolically from a host batch, checking the labels first."""
    x, y, sample_weight = jax.tree.map(spec, batch)
    try:
        y_pred = _compat.compute_output_spec(model, x, training=False)
    except Exception as error:
        raise ValueError(
            "The model could not be built on the data's x (shapes "
            f"{jax.tree.map(lambda s: tuple(s.shape), x)}). Check that x matches "
            "the model's inputs, or build the model yourself with "
            f"model.build(input_shape). Keras reported: {error}"
        ) from error
    if y is None:
        return  # inputs only (predict): the symbolic call built every layer
    if _compat.compiled_loss(model) is not None:
        check_labels(model, x, y, y_pred, sample_weight)
    _compat.symbolic_build(model, batch)


def check_labels(model, x, y, y_pred, sample_weight):
    """Raise a `ValueError` naming the shapes if `y` does not fit `y_pred` under the loss."""
    try:
        _compat.compute_output_spec(
            model.compute_loss, x=x, y=y, y_pred=y_pred,
            sample_weight=sample_weight, training=False,
        )
    except Exception as error:
        shapes = lambda tree: jax.tree.map(lambda s: tuple(s.shape), tree)  # noqa: E731
        raise ValueError(
            f"The labels do not fit the model's output under its loss: y has "
            f"shape {shapes(y)}, the model outputs shape {shapes(y_pred)}, and "
            f"the loss is {model.loss!r}. Give labels in the form the loss "
            "expects: integer class ids of shape (batch,) for "
            "sparse_categorical_crossentropy, one-hot rows of shape (batch, "
            f"classes) for categorical_crossentropy. Keras reported: {error}"
        ) from error


def signature(batch):
    """A hashable summary of a host batch: its structure, shapes and dtypes."""
    leaves, treedef = jax.tree.flatten(batch)
    return treedef, tuple((np.shape(leaf), str(getattr(leaf, "dtype", type(leaf))))
                          for leaf in leaves)


def spec(array):
    """A `keras.KerasTensor` with the shape and dtype of `array`."""
    return keras.KerasTensor(np.shape(array), dtype=keras.backend.standardize_dtype(array.dtype))
