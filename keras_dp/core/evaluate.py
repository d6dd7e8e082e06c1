"""The loops that run the model without training it: `evaluate` and `predict`.

Both read their data as `fit` does (`placement.steps`: K batches of one
row count per compiled call, the rest one by one) and call the trainer's
compiled test or predict programs, with Keras's callback hooks around each
call. `fit`'s validation runs `evaluate` with the live weights
(`keras_dp.core.loop.validate`). Each takes the `ShardedTrainer` whose parts it
runs.
"""

import contextlib

import jax
import numpy as np

from keras_dp.multihost import agreement
from keras_dp.keras import callbacks as callbacks_lib
from keras_dp.core import inflight
from keras_dp.checks import labels as labels_lib
from keras_dp.core import placement as placement_lib
from keras_dp.core import programs as programs_lib
from keras_dp.core.state import fresh_metrics


def evaluate(trainer, weights, batches, callbacks, before_end, programs=None):
    """Score `batches` with `weights` (`(trainable, non_trainable)`, or a function giving them).

    A function is called after `on_test_begin`, as Keras's evaluate reads
    the model only then: a callback may change it there
    (`keras.callbacks.SwapEMAWeights` swaps the moving averages in).

    Runs `steps_per_execution` test steps per compiled call over stacked
    batches of one row count, and the rest (a partial batch, the last
    fewer than K) one by one, as `fit` does; callbacks see each call.
    The calls run through `programs` (a `programs.EvalPrograms` of
    `batches`, made here if None), which compiles each call shape's
    program once, ahead of its first call where it can.
    `before_end(non_trainable, metrics)` gets the values the last test step
    left, before `on_test_end`: where Keras's evaluate gives them to the
    model, so that what a callback changes there is kept.

    Returns:
        The final logs as python floats, in Keras's order.
    """
    if programs is None:  # its own: what it compiles ahead ends with it
        with contextlib.closing(programs_lib.EvalPrograms(trainer, batches)) as programs:
            return evaluate(trainer, weights, batches, callbacks, before_end, programs)
    labels_lib.check_data(trainer.model, (batches, "the data"))
    metrics = fresh_metrics(trainer.model, trainer.mesh, trainer.state_layout().metrics)
    throttle = inflight.Throttle(trainer.steps_in_flight)
    logs, index = None, 0
    trainer.model.stop_evaluating = False  # as Keras's evaluate clears it
    callbacks.on_test_begin()
    trainable, non_trainable = weights() if callable(weights) else weights
    placed = trainer.placement.steps(
        batches.epoch(0), trainer.steps_per_execution, batches.peek(),
        placement_lib.planned_rows(batches))
    with contextlib.closing(placed), callbacks_lib.released_on_error(callbacks):
        for steps, device_batch in placed:
            callbacks.on_test_batch_begin(index)
            non_trainable, metrics, logs = programs.call(
                (trainable, non_trainable), metrics, steps, device_batch)
            throttle.add(logs)
            index += steps
            callbacks.on_test_batch_end(index - 1, logs)
            if _stops(trainer, "stop_evaluating", placed, index - 1):
                break
    throttle.drain()
    logs = callbacks_lib.to_python(logs, trainer.model, metrics, "test_step")
    before_end(non_trainable, metrics)
    callbacks.on_test_end(logs)
    return logs


def predict(trainer, weights, batches, callbacks):
    """The model's outputs for every row of `batches`, in order, and the non-trainable values.

    `steps_per_execution` predict steps per compiled call, as `evaluate`
    runs them; `on_predict_batch_end` gets each call's outputs (K batches'
    rows, concatenated), as under `model.predict`. Each call's outputs are
    copied to the host before the next is dispatched. The non-trainable
    values are carried from call to call, as `model.predict` carries them
    (a `SeedGenerator` advances each batch). `weights` may be a function,
    called after `on_predict_begin` (see `evaluate`).

    Returns:
        `(outputs, non_trainable)`: numpy arrays with one row per input
        row, and the non-trainable values the last predict step left.
    """
    placement, outputs, index = trainer.placement, [], 0
    trainer.model.stop_predicting = False  # as Keras's predict clears it
    callbacks.on_predict_begin()
    weights = weights() if callable(weights) else weights
    trainable, non_trainable = weights
    inputs = (batch[0] for batch in batches.epoch(0))
    placed = placement.steps(inputs, trainer.steps_per_execution, batches.peek()[0],
                             placement_lib.planned_rows(batches))
    with contextlib.closing(placed), callbacks_lib.released_on_error(callbacks):
        for steps, x_device in placed:
            callbacks.on_predict_batch_begin(index)
            output, non_trainable = trainer.programs.predict(steps)(
                (trainable, non_trainable), x_device)
            rows = placement.local_rows if steps == 1 else placement.stacked_local_rows
            output = jax.tree.map(lambda out: rows(out, x_device), output)  # noqa: B023
            outputs.append(output)
            index += steps
            callbacks.on_predict_batch_end(index - 1, {"outputs": output})
            if _stops(trainer, "stop_predicting", placed, index - 1):
                break
    callbacks.on_predict_end()
    return jax.tree.map(_join, *outputs), non_trainable


def _stops(trainer, flag, placed, index):
    """Whether a callback set `model.<flag>`, stopping the loop after batch `index`, as Keras's does.

    Across processes, a stop before the last batch must be every process's
    (`agreement.stop_mid_pass`); finding whether it is the last places the
    next batch, which the stop then drops.
    """
    if not getattr(trainer.model, flag, False):
        return False
    if trainer.multiprocess and next(placed, None) is not None:
        agreement.stop_mid_pass(trainer.placement, flag, index)
    return True


def _join(*parts):
    """One output's parts, one per call, joined along the rows, or a `ValueError` naming the shapes."""
    shapes = sorted({np.shape(part)[1:] for part in parts})
    if len(shapes) > 1:
        raise ValueError(
            f"predict's batches gave outputs of different shapes after the rows "
            f"({', '.join(map(str, shapes))}), which cannot be joined into one array "
            "(Keras's model.predict cannot either): a model that outputs one value "
            "per timestep, on batches padded to different lengths. Pad every batch "
            "to one length (padded_batch(..., padded_shapes=...)), or predict each "
            "length's batches apart."
        )
    return np.concatenate(parts)
