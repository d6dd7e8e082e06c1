"""The loops that run the model without training it: `evaluate` and `predict`.

Both read their data as `fit` does (the hosts' `steps`: K batches of one
row count per compiled call, the rest one by one) and call the trainer's
compiled test or predict programs, with Keras's callback hooks around each
call. `fit`'s validation runs `evaluate` with the live weights
(`keras_dp.core.loop.validate`). Each takes the `ShardedTrainer` whose parts it
runs.
"""

import contextlib

import jax
import numpy as np

from keras_dp.checks import labels as labels_lib
from keras_dp.core import programs as programs_lib
from keras_dp.core.feed import Cadence
from keras_dp.core.live import Throttle
from keras_dp.core.state import TrainState
from keras_dp.core.state import fresh_metrics
from keras_dp.core.state import model_weights
from keras_dp.core.state import write_back
from keras_dp.keras import callbacks as callbacks_lib


def evaluate(trainer, weights, batches, callbacks, before_end, programs=None):
    """Score `batches` with `weights()`, a function giving `(trainable, non_trainable)`.

    It is called after `on_test_begin`, as Keras's evaluate reads the
    model only then: a callback may change it there
    (`keras.callbacks.SwapEMAWeights` swaps the moving averages in).

    Runs `steps_per_execution` test steps per compiled call over stacked
    batches of one row count, and the rest (a partial batch, the last
    fewer than K) one by one, as `fit` does; the batch hooks come once per
    K batches, as under Keras's `evaluate` (`Cadence`).
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
        programs = programs_lib.EvalPrograms(
            trainer.programs, batches, layout=trainer.layout,
            steps_per_execution=trainer.steps_per_execution, ahead=trainer.hosts.compiles_ahead)
        with contextlib.closing(programs):
            return evaluate(trainer, weights, batches, callbacks, before_end, programs)
    labels_lib.check_data(trainer.model, (batches, "the data"))
    metrics = fresh_metrics(trainer.model, trainer.mesh, trainer.state_layout().metrics)
    throttle = Throttle(trainer.steps_in_flight)
    logs, index = None, 0
    trainer.model.stop_evaluating = False  # as Keras's evaluate clears it
    callbacks.on_test_begin()
    trainable, non_trainable = weights()
    placed = trainer.hosts.steps(batches.epoch(0), trainer.steps_per_execution, batches.peek(),
                                 batches.planned_rows())
    cadence = Cadence(trainer.steps_per_execution)
    with contextlib.closing(placed), callbacks_lib.released_on_error(callbacks):
        for steps, device_batch in placed:
            if cadence.begins(index):
                callbacks.on_test_batch_begin(index)
            non_trainable, metrics, logs = programs.call(
                (trainable, non_trainable), metrics, steps, device_batch)
            throttle.add(logs)
            index += steps
            end = cadence.ends(index)
            if end is not None:
                callbacks.on_test_batch_end(end, logs)
                if _stops(trainer, "stop_evaluating", placed, index - 1):
                    break
        end = cadence.close()  # the group the data ended in
        if end is not None:
            callbacks.on_test_batch_end(end, logs)
    throttle.drain()
    logs = callbacks_lib.to_python(logs, trainer.model, metrics, "test_step")
    before_end(non_trainable, metrics)
    callbacks.on_test_end(logs)
    return logs


def predict(trainer, weights, batches, callbacks):
    """The model's outputs for every row of `batches`, in order, and the non-trainable values.

    `steps_per_execution` predict steps per compiled call, as `evaluate`
    runs them; `on_predict_batch_end` gets each group's outputs (K
    batches' rows, concatenated; `Cadence`), as under
    `model.predict`. Each call's outputs are
    copied to the host before the next is dispatched. The non-trainable
    values are carried from call to call, as `model.predict` carries them
    (a `SeedGenerator` advances each batch). `weights` is a function,
    called after `on_predict_begin` (see `evaluate`).

    Returns:
        `(outputs, non_trainable)`: numpy arrays with one row per input
        row, and the non-trainable values the last predict step left.
    """
    hosts, outputs, index = trainer.hosts, [], 0
    trainer.model.stop_predicting = False  # as Keras's predict clears it
    callbacks.on_predict_begin()
    trainable, non_trainable = weights()
    inputs = (batch[0] for batch in batches.epoch(0))
    placed = hosts.steps(inputs, trainer.steps_per_execution, batches.peek()[0],
                         batches.planned_rows())
    cadence, group = Cadence(trainer.steps_per_execution), 0
    with contextlib.closing(placed), callbacks_lib.released_on_error(callbacks):
        for steps, x_device in placed:
            if cadence.begins(index):
                callbacks.on_predict_batch_begin(index)
                group = len(outputs)
            output, non_trainable = trainer.programs.predict(steps)(
                (trainable, non_trainable), x_device)
            rows = hosts.local_rows if steps == 1 else hosts.stacked_local_rows
            outputs.append(jax.tree.map(lambda out: rows(out, x_device), output))  # noqa: B023
            index += steps
            end = cadence.ends(index)
            if end is not None:
                callbacks.on_predict_batch_end(end, {"outputs": _joined(outputs[group:])})
                if _stops(trainer, "stop_predicting", placed, index - 1):
                    break
        end = cadence.close()  # the group the data ended in
        if end is not None:
            callbacks.on_predict_batch_end(end, {"outputs": _joined(outputs[group:])})
    callbacks.on_predict_end()
    return jax.tree.map(_join, *outputs), non_trainable


def _stops(trainer, flag, placed, index):
    """Whether a callback set `model.<flag>`, stopping the loop after batch `index`, as Keras's does.

    Across processes, a stop before the last batch must be every process's
    (the hosts' `stop_mid_pass`).
    """
    if not getattr(trainer.model, flag, False):
        return False
    trainer.hosts.stop_mid_pass(placed, flag, index)
    return True


def _joined(parts):
    """A group's outputs, one per call, as one (the K batches' rows, as Keras's hook gets them)."""
    return parts[0] if len(parts) == 1 else jax.tree.map(_join, *parts)


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


def evaluate_call(trainer, batches, callbacks, verbose, return_dict=False):
    """`ShardedTrainer.evaluate` on a prepared source: Keras's callbacks, the loop, the result.

    As `model.evaluate` does, the model keeps what the test steps left,
    given to it before `on_test_end`, so what a callback changes there
    stays. Returns the loss alone when there are no metrics, else a list
    in the order of `model.metrics_names`, or with `return_dict` a dict by
    name in sorted order (as Keras's logs are).
    """
    model = trainer.model
    callbacks = callbacks_lib.callback_list(callbacks, model, verbose, history=False,
                                            epochs=1, steps=batches.steps)

    def keep(non_trainable, metrics):
        write_back(TrainState(None, non_trainable, None, metrics), model)

    with trainer.hosts.watch("evaluate"):
        logs = evaluate(  # read after on_test_begin
            trainer, lambda: model_weights(model, trainer.mesh, trainer.state_layout()),
            batches, callbacks, keep)
    if return_dict:
        return dict(sorted(logs.items()))
    return callbacks_lib.in_evaluate_order(logs, model)


def predict_call(trainer, batches, callbacks, verbose):
    """`ShardedTrainer.predict` on a prepared source: outputs with one row per input row.

    As `model.predict` does, the model keeps the non-trainable values the
    predict steps leave (a SeedGenerator's state); the model may have no
    optimizer here, so the weights are laid out from the model's variables.
    """
    model = trainer.model
    callbacks = callbacks_lib.callback_list(callbacks, model, verbose, history=False,
                                            epochs=1, steps=batches.steps)
    shardings = trainer.layout.state_shardings(TrainState(
        model.trainable_variables, model.non_trainable_variables, None, None))
    with trainer.hosts.watch("predict"):
        outputs, non_trainable = predict(  # read after on_predict_begin
            trainer, lambda: model_weights(model, trainer.mesh, shardings), batches, callbacks)
    write_back(TrainState(None, non_trainable, None, None), model,
               TrainState(None, model.non_trainable_variables, None, None))
    return outputs
