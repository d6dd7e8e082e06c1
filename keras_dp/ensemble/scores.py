"""Classification scores from probabilities, computed on the host.

The ensemble's averaged probabilities are scored as Keras's `evaluate`
scores a model compiled with `loss="sparse_categorical_crossentropy"` (or
`"categorical_crossentropy"`) and `metrics=["accuracy"]`, the way a
classifier's own `val_loss` and `val_accuracy`, logged beside them, are
computed: the loss weighs each row by its sample weight and divides by the
row count (Keras's `"sum_over_batch_size"`), and `"accuracy"`, a metric
given in `metrics` rather than `weighted_metrics`, counts every row alike.
"""

import numpy as np

# Keras clips probabilities to [epsilon, 1 - epsilon] before taking logs.
EPSILON = 1e-7


def classification_scores(probabilities, y, sample_weight=None):
    """Return `(loss, accuracy)` of probabilities against labels.

    Args:
        probabilities: shape `(..., N, classes)`; leading axes (members)
            are scored separately.
        y: class ids of shape `(N,)` or `(N, 1)`, or one-hot (or soft)
            rows of shape `(N, classes)`.
        sample_weight: optional weights of shape `(N,)`.

    Returns:
        Arrays of shape `probabilities.shape[:-2]`: the cross-entropy of
        the labels under the clipped probabilities, each row's times its
        `sample_weight` when given, summed and divided by `N` (as Keras's
        compiled loss); and the share of rows whose most probable class is
        the label (the first, on ties), not weighted (as Keras's
        `metrics=["accuracy"]`).

    Raises:
        ValueError: labels of any other shape.
    """
    probabilities = np.asarray(probabilities)
    classes = probabilities.shape[-1]
    y = np.asarray(y)
    if y.shape == probabilities.shape[-2:]:
        targets = y.astype(np.float32)
    elif y.ndim == 1 or (y.ndim == 2 and y.shape[1] == 1):
        targets = np.eye(classes, dtype=np.float32)[y.reshape(-1).astype(int)]
    else:
        raise ValueError(
            "Scoring needs class ids of shape (N,) or (N, 1), or one-hot rows "
            f"of shape {probabilities.shape[-2:]}. Received labels of shape "
            f"{y.shape}."
        )
    clipped = np.clip(probabilities, EPSILON, 1 - EPSILON)
    losses = -(targets * np.log(clipped)).sum(axis=-1)
    correct = probabilities.argmax(axis=-1) == targets.argmax(axis=-1)
    weights = np.ones(len(y)) if sample_weight is None else np.reshape(sample_weight, -1)
    return (losses * weights).sum(axis=-1) / len(y), correct.mean(axis=-1)
