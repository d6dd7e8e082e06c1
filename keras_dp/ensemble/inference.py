"""The ensemble's loops that run the members without training them: `evaluate` and `predict`.

They run as `keras_dp.core.evaluate` runs one model: Keras's callback hooks
around each compiled call (a progress bar unless `verbose=0`), the
non-trainable values carried from batch to batch, and each call's results
read to the host before the next is dispatched (one call in flight, on every
platform: what XLA:CPU needs, and elsewhere a limit of these loops). The model
the callbacks see is the averaging model; the batch logs they get are the
members' means, as in `fit`. Each takes the `EnsembleTrainer` whose parts it
runs.
"""

import itertools

import jax
import numpy as np

from keras_dp import sharding
from keras_dp import sources
from keras_dp.ensemble import logs as logs_lib
from keras_dp.ensemble import members as members_lib
from keras_dp.ensemble.scores import classification_scores


def evaluate(trainer, weights, batches, callbacks, before_end):
    """Score `batches` with `weights` (a function giving the stacked `(trainable, non_trainable)`).

    `weights` is called after `on_test_begin`, as Keras's evaluate reads
    the model only then. Each member runs `model.evaluate`'s test step from
    reset metrics; its scores are what `model.evaluate` reports
    (`logs_lib.member_logs`). The ensemble is scored on the host from
    the mean probabilities (`keras_dp.ensemble.scores`).
    `before_end(non_trainable, metrics)` gets the stacked values the last
    step left, before `on_test_end`: where Keras's evaluate gives them to
    the model, so that what a callback changes there is kept (as
    `keras_dp.core.evaluate.evaluate` does for one model).

    Returns:
        `{name: [M values]}` for each member's log, plus the floats
        `ensemble_loss` and `ensemble_accuracy`.

    Raises:
        ValueError: the batches have no labels.
    """
    check_labels(batches)
    for member in trainer.members:  # as model.evaluate starts
        member.reset_metrics()
    metrics = members_lib.stack_state(trainer.members, trainer.mesh, groups=("metrics",)).metrics
    parts, labels, sample_weights = [], [], []
    callbacks.model.stop_evaluating = False  # as Keras's evaluate clears it
    callbacks.on_test_begin()
    trainable, non_trainable = weights()
    for first, group in _groups(trainer, batches):
        callbacks.on_test_batch_begin(first)
        for batch in group:
            probabilities, non_trainable, metrics, logs = trainer._test_step(
                ((trainable, non_trainable), metrics), trainer.replicate(batch))
            parts.append(np.asarray(probabilities))  # waits for the step
            labels.append(_one_output(batch[1]))
            sample_weights.append(_one_output(batch[2]))
        callbacks.on_test_batch_end(first + trainer.steps_per_execution - 1,
                                    logs_lib.batch_means(logs))
        if callbacks.model.stop_evaluating:  # a callback stopped it, as under Keras
            break
    scores = logs_lib.member_logs(trainer, logs, metrics, "test_step")
    scores.update(_ensemble_scores(np.concatenate(parts, axis=1).mean(axis=0), labels,
                                   sample_weights))
    before_end(non_trainable, metrics)
    callbacks.on_test_end(logs_lib.mean_logs(scores))
    return scores


def check_labels(batches, name="x"):
    """Refuse data without labels, which the ensemble cannot be scored on, before any step.

    Raises:
        ValueError: `batches` (the argument `name`) have no labels.
    """
    if sources.unpack(batches.peek())[1] is None:
        fix = "validation_data=(x_val, y_val)" if name == "validation_data" else "y"
        raise ValueError(
            f"Scoring needs labels, and `{name}` has none. Pass {fix}, or (x, y) batches."
        )


def predict(trainer, weights, batches, callbacks):
    """Each member's class probabilities on `batches`, `(M, N, classes)`, and the non-trainable values.

    `weights` is called after `on_predict_begin`; `on_predict_batch_end`
    gets `{"outputs": the call's mean probabilities}`.
    """
    parts = []
    callbacks.model.stop_predicting = False  # as Keras's predict clears it
    callbacks.on_predict_begin()
    trainable, non_trainable = weights()
    for first, group in _groups(trainer, batches):
        callbacks.on_predict_batch_begin(first)
        for batch in group:
            x = jax.device_put(batch[0], sharding.replicated(trainer.mesh))
            probabilities, non_trainable = trainer._predict_step((trainable, non_trainable), x)
            parts.append(np.asarray(probabilities))  # waits for the step
        outputs = np.concatenate(parts[-len(group):], axis=1).mean(axis=0)
        callbacks.on_predict_batch_end(first + trainer.steps_per_execution - 1,
                                        {"outputs": outputs})
        if callbacks.model.stop_predicting:  # a callback stopped it, as under Keras
            break
    callbacks.on_predict_end()
    return np.concatenate(parts, axis=1), non_trainable


def _groups(trainer, batches):
    """Yield `(index of the first batch, [batches])`: the batches Keras's hooks see as one call.

    With `steps_per_execution` K, `model.evaluate` and `model.predict` call
    the batch hooks once per K batches, a last group of fewer included
    (`callbacks.Cadence`, as `fit` does); the ensemble runs them one by one
    within. A group's end index is its first's + K - 1, as in Keras.
    """
    steps_per_execution = trainer.steps_per_execution
    unpacked = (sources.unpack(batch) for batch in batches.epoch(0))
    for index in itertools.count(0, steps_per_execution):
        group = list(itertools.islice(unpacked, steps_per_execution))
        if not group:
            return
        yield index, group


def _one_output(values):
    """The one output's labels (or sample weights), also given nested as Keras takes them: `(y,)`."""
    leaves = jax.tree.leaves(values)
    return leaves[0] if len(leaves) == 1 else values


def _ensemble_scores(probabilities, labels, sample_weights):
    y = np.concatenate(labels)
    sample_weight = None if sample_weights[0] is None else np.concatenate(sample_weights)
    loss, accuracy = classification_scores(probabilities, y, sample_weight)
    return {"ensemble_loss": float(loss), "ensemble_accuracy": float(accuracy)}
