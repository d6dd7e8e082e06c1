"""The ensemble's logs: each member's as its own `model.fit` reports them, and their means.

Compiled steps return logs with a leading member axis, `{name: (M,) array}`.
Each member's are read as Keras reads one model's (`callbacks_lib.to_python`),
kept per epoch in `EnsembleTrainer.member_history`, and Keras's callbacks get
one float per name: the members' mean.
"""

import jax
import numpy as np

from keras_dp.keras import callbacks as callbacks_lib


def member_logs(trainer, logs, metrics, step="train_step"):
    """Each member's logs, `{name: [M values]}`, as its `model.fit` (or `evaluate`) reports them.

    `logs` are the last call's, `metrics` the stacked metric values it
    left. Member `i`'s are what `callbacks_lib.to_python` makes of its row:
    the metrics' results when the member overrides `step` and logs its
    metrics' names, as Keras does (`Trainer._get_metrics_result_or_logs`),
    else its logs.
    """
    if not logs:
        return {}
    logs, metrics = jax.device_get((logs, metrics))
    per_member = [
        callbacks_lib.to_python(jax.tree.map(lambda values: values[i], logs), member,
                                [values[i] for values in metrics], step)
        for i, member in enumerate(trainer.members)
    ]
    return {name: [np.asarray(member[name]).tolist() for member in per_member]
            for name in per_member[0]}


def mean_logs(per_member):
    """`{name: [M values]}` (floats pass through) as Keras's logs: the members' means."""
    return {name: float(np.mean(value)) for name, value in per_member.items()}


def batch_means(logs):
    """A call's logs, `{name: (M,) array}`, as the members' means (what callbacks get)."""
    return mean_logs(callbacks_lib.flatten_logs(jax.device_get(logs)))  # a dict metric's entries
