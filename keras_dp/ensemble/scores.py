"""Classification scores from probabilities, computed on the host.

The ensemble's members and their average are scored the same way, from
class probabilities, so that their numbers can be compared directly.
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
        the labels under the clipped probabilities, and the share of rows
        whose most probable class is the label (the first, on ties). Both
        are means over rows, weighted by `sample_weight` when given.

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
    total = weights.sum()
    return (losses * weights).sum(axis=-1) / total, (correct * weights).sum(axis=-1) / total
