"""The ensemble's `fit` loop: epochs of compiled calls, with Keras's callbacks.

It runs the way `keras_dp.core.loop` runs one model's `fit`: `on_train_begin`,
then per epoch `on_epoch_begin`, one compiled call of one or K steps per
`on_train_batch_begin` / `on_train_batch_end`, validation, `on_epoch_end`,
and `stop_training` honoured after every call and epoch. The model the
callbacks see is the ensemble's averaging model, whose weights are the
members' own; a `MembersLive` keeps them current whenever a callback looks.

Logs are Keras's: one float per name. Each is the members' mean of what
each member's `model.fit` would log, `val_*` included (each member runs
Keras's test step); `val_ensemble_loss` / `val_ensemble_accuracy` score the
averaged probabilities. Each member's own
values are kept per epoch in `EnsembleTrainer.member_history`.
"""

import functools

import jax
import keras
import numpy as np

from keras_dp import _compat
from keras_dp import options
from keras_dp.core import state as state_lib
from keras_dp.core.feed import Cadence
from keras_dp.core.live import ADVICE
from keras_dp.core.live import LiveModel
from keras_dp.core.state import TrainState
from keras_dp.ensemble import inference as ensemble_inference
from keras_dp.ensemble import logs as logs_lib
from keras_dp.ensemble import members as members_lib
from keras_dp.keras import callbacks as callbacks_lib


class MembersLive(LiveModel):
    """A `LiveModel` whose state is the members' stacked state.

    `model` is the averaging model the callbacks hold; writing back
    assigns each member its row, and a callback that changed any member's
    weights makes the trainer read the members again before the next step.
    """

    def __init__(self, model, members):
        self.members = members
        super().__init__(model)

    def _compared_variables(self):
        return [variable for member in self.members
                for group in TrainState.variables_of(member)._replace(metrics=[])
                for variable in group]

    def _state_variables(self):
        return None  # `_write` writes each member's own variables

    def _write(self, state):
        members_lib.write_back_members(state, self.members)


def check_callbacks(callbacks):
    """Refuse Keras's `SwapEMAWeights`, which swaps `model.optimizer`'s EMA weights in.

    Each member has its own optimizer, and the averaging model that
    callbacks are given has none (`optimizer` is `None`; the learning-rate
    callbacks see the members' optimizers instead, see
    `give_learning_rate_callbacks_the_members`).

    Raises:
        ValueError: a `SwapEMAWeights`, or a `TensorBoard` with
            `write_steps_per_second=True` (it reads `model.optimizer`).
    """
    for callback in callbacks or ():
        if isinstance(callback, keras.callbacks.TensorBoard) and callback.write_steps_per_second:
            raise ValueError(
                "TensorBoard(write_steps_per_second=True) counts steps with "
                "model.optimizer.iterations, but an ensemble's members each have "
                "their own optimizer and the averaging model given to callbacks has "
                "none. Drop write_steps_per_second: the other logs are written as "
                "under model.fit.")
        if isinstance(callback, keras.callbacks.SwapEMAWeights):
            raise ValueError(
                "SwapEMAWeights swaps model.optimizer's moving averages into the "
                "model, but an ensemble's members each have their own optimizer and "
                "the averaging model given to callbacks has none. Remove it: a "
                "member whose optimizer has use_ema=True ends fit with its moving "
                "averages as its weights, as under model.fit."
            )


def give_learning_rate_callbacks_the_members(callbacks, members):
    """Let `LearningRateScheduler` and `ReduceLROnPlateau` set every member's learning rate.

    Each such callback of the `CallbackList` gets a view of the averaging
    model whose `optimizer` lists the members' optimizers in `optimizers`:
    Keras's callbacks set the learning rate of each optimizer so listed,
    as for a model with several optimizers, and log each as
    `learning_rate_member_<i>`; its `iterations` are the members' steps.
    The averaging model itself keeps no optimizer (see
    `EnsembleTrainer.averaging_model`).
    """
    for callback in callbacks.callbacks:
        if isinstance(callback, (keras.callbacks.LearningRateScheduler,
                                 keras.callbacks.ReduceLROnPlateau)):
            callback.set_model(_WithMembersOptimizers(callbacks.model, members))


class _MemberOptimizer:
    """Member `index`'s optimizer as Keras's learning-rate callbacks read it: named `member_<index>`.

    Reads go to the optimizer; of the writes, only `learning_rate`
    (another attribute set here would change nothing, so it raises).
    """

    __slots__ = ("_optimizer", "name")

    def __init__(self, optimizer, index):
        self._optimizer = optimizer
        self.name = f"member_{index}"

    @property
    def learning_rate(self):
        return self._optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, value):
        self._optimizer.learning_rate = value  # Keras raises for a schedule, as under fit

    def __getattr__(self, name):
        return getattr(self._optimizer, name)


class _MembersOptimizers:
    """The members' optimizers, listed as Keras lists a model's several optimizers."""

    def __init__(self, members):
        object.__setattr__(self, "optimizers", [_MemberOptimizer(member.optimizer, index)
                                                for index, member in enumerate(members)])
        object.__setattr__(self, "_first", members[0].optimizer)

    @property
    def iterations(self):
        """The steps taken: every member takes each one."""
        return self._first.iterations

    def __setattr__(self, name, value):
        # A callback that sets model.optimizer.learning_rate itself would
        # change nothing: say where the members' optimizers are.
        raise AttributeError(
            f"An ensemble's callbacks see model.optimizer as the members' optimizers, "
            f"in model.optimizer.optimizers; set {name} on each of those (as Keras's "
            "LearningRateScheduler does for a model with several optimizers).")


class _WithMembersOptimizers:
    """The averaging model, but for its `optimizer`: the members' (`_MembersOptimizers`).

    Everything else is read from and written to the averaging model, whose
    `jax_state_sync` (what Keras's `Callback.model` calls) keeps the members
    current and notes that a callback looked.
    """

    def __init__(self, model, members):
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "optimizer", _MembersOptimizers(members))

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __setattr__(self, name, value):
        setattr(self._model, name, value)


def resolve_monitors(callbacks, member):
    """Settle `mode="auto"` of monitoring callbacks before training, as each member's would.

    Keras infers whether a monitored log should fall or rise from the
    model's compiled metrics, and the averaging model that callbacks are
    given is not compiled: `EarlyStopping("val_accuracy")` or a
    `ModelCheckpoint(..., save_best_only=True)` raised after the first
    epoch. A name of the members' (`val_accuracy`, ...) is settled from
    `member`'s metrics, as under its `model.fit`; `ensemble_loss` falls and
    `ensemble_accuracy` rises. Keras's own `ValueError` (pass `mode=`)
    comes before any step for a name neither knows.
    """
    for callback in callbacks or ():
        if not _compat.unsettled_monitor(callback):
            continue
        name = callback.monitor.removeprefix("val_")
        if name in ("ensemble_loss", "ensemble_accuracy"):
            callback.mode = "min" if name == "ensemble_loss" else "max"
        _compat.settle_monitor(callback, member)  # from the member's compiled metrics


def fit(trainer, sources, val, callbacks, *, epochs, validation_freq):
    """Train the `epochs` (a range of epoch indices) of `sources` (one per member, or one for all).

    Fills `trainer.member_history` (emptied first) and returns the History
    of `callbacks`. Whatever ends the loop, every member holds the state of
    its last completed step when this returns or raises.
    """
    model = callbacks.model
    model.stop_training = False
    live = MembersLive(model, trainer.members)
    trainer.member_history = {}
    callbacks.on_train_begin()
    # A BackupAndRestore that restored a backup moves the start, as under model.fit.
    epochs = range(_compat.take_initial_epoch(model) or epochs.start, epochs.stop)
    logs = {}
    with live.attached(), callbacks_lib.released_on_error(callbacks):
        try:
            for epoch in epochs:
                callbacks.on_epoch_begin(epoch)
                start_epoch(trainer, live, epoch)
                per_member = logs_lib.member_logs(
                    trainer, train_epoch(trainer, live, sources, epoch, callbacks),
                    live.state.metrics)
                if val is not None and options.should_validate(epoch, validation_freq):
                    per_member.update(validate(trainer, live, val, callbacks))
                for name, value in per_member.items():
                    trainer.member_history.setdefault(name, []).append(value)
                logs = logs_lib.mean_logs(per_member)
                callbacks.on_epoch_end(epoch, logs)
                if model.stop_training or getattr(sources[0], "exhausted", False):
                    break  # a one-shot stream that ran out stops, as under model.fit
        finally:
            live.finish()
            for source in sources:  # a stream's open pass, and the threads reading it
                source.close()
            if epochs.stop > 0:  # Keras's own end of fit: e.g. EMA weights into the model
                for member in trainer.members:
                    state_lib.finalize_variable_values(member)
    callbacks.on_train_end(logs)
    return _history(callbacks)


def start_epoch(trainer, live, epoch):
    """Reset every member's metrics, as Keras does each epoch, and bring the state in."""
    for member in trainer.members:
        member.reset_metrics()
    if live.needs_read():  # the first epoch, or a callback changed a member
        live.read(trainer.init_state(), (epoch, 0))
    else:
        fresh = members_lib.stack_state(trainer.members, trainer.mesh, groups=("metrics",))
        live.state = live.state._replace(metrics=fresh.metrics)


def train_epoch(trainer, live, sources, epoch, callbacks):
    """Run one epoch's calls; return the last call's logs (`{name: (M,) array}`; `{}` if none).

    Each call's logs are read to the host before the next call is
    dispatched (the progress bar and callbacks get floats), so one call is
    in flight at a time, on every platform: what XLA:CPU needs, and on an
    accelerator a limit of the ensemble's loop (`ShardedTrainer` keeps two
    in flight there).

    Raises:
        FloatingPointError: a member's loss was NaN or Inf (unless a
            callback such as `TerminateOnNaN` stopped training instead).
    """
    index, logs, member_logs = 0, {}, {}
    cadence = Cadence(trainer.steps_per_execution)
    for steps, batch, per_member in trainer._calls(sources, epoch):
        if cadence.begins(index):
            callbacks.on_train_batch_begin(index)
        if live.needs_read():  # a callback changed a member
            live.read(trainer.init_state(), (epoch, index))
        step = trainer._step(per_member, steps)
        logs, finite = live.advance(lambda state: step(state, batch), (epoch, index + steps))
        finite = jax.device_get(finite)
        member_logs = {name: np.asarray(values).tolist() for name, values in
                       callbacks_lib.to_python(logs, trainer.members[0]).items()}
        failed = [(member, index + int(count)) for member, count in enumerate(finite)
                  if count < steps]
        index += steps
        end = cadence.close() if failed else cadence.ends(index)
        if end is not None:
            callbacks.on_train_batch_end(end, logs_lib.mean_logs(member_logs))
        if failed and not callbacks.model.stop_training:
            raise FloatingPointError(failure_message(epoch, failed, member_logs["loss"]))
        if end is not None and callbacks.model.stop_training:
            break
    end = cadence.close()  # the group the data ended in
    if end is not None:
        callbacks.on_train_batch_end(end, logs_lib.mean_logs(member_logs))
    return logs


def validate(trainer, live, val, callbacks):
    """Score `val` with the members' current weights: `{val_<name>: value}`.

    As under `model.fit`: the callbacks' test hooks run, the non-trainable
    values the steps leave (a seed generator advanced in inference mode)
    carry into the next epoch, the members' metrics hold the validation's
    results until the next epoch resets them, and a member a callback
    changed (at the last batch's end, or in `on_test_begin`) is scored as
    changed, and what one changes in `on_test_end` (a BatchNormalization
    statistic) is kept and trained on.
    """
    tested = functools.partial(live.tested, trainer.init_state, hosts=trainer.hosts,
                               model_read=callbacks_lib.beyond_logs(callbacks))
    scores = ensemble_inference.evaluate(
        trainer, lambda: live.current(trainer.init_state, trainer.hosts).weights, val,
        callbacks, tested)
    return {f"val_{name}": value for name, value in scores.items()}


def failure_message(epoch, failed, losses):
    """The error for members whose loss or update stopped being finite, `failed`: `[(member, batch)]`.

    The guard in the compiled step (`keras_dp.core.steps.keep_if_not_finite`) sets a
    member's logs to NaN after a non-finite update, so both show in its loss.
    """
    which = ", ".join(f"member {member} at batch {batch} (loss {losses[member]})"
                      for member, batch in failed)
    return (
        f"The loss or the weight update stopped being finite in epoch {epoch + 1}: "
        f"{which}, batches counted from 0 within the epoch, as callbacks count. "
        "Training stopped. Each of those members holds its weights from before "
        "that batch; every other member holds its weights after the last batch "
        "that ran. " + ADVICE
    )


def _history(callbacks):
    """The `keras.callbacks.History` of `callbacks` (`callbacks_lib.callback_list` adds one)."""
    return next(callback for callback in callbacks.callbacks
                if isinstance(callback, keras.callbacks.History))
