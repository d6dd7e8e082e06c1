"""The training state and its boundaries with the Keras model.

`TrainState` is the one definition of what a train step reads and replaces.
`TrainState.from_model` reads a built, compiled Keras model into device
arrays (replicated, or split as `keras_dp.layout` says); `write_back` is
the only code in keras_dp that assigns to Keras variables. In between, the
state lives only in the compiled steps, which take it and return its
successor. During `fit`, `LiveModel` holds the state of the epoch in
progress and keeps the Keras model in step with it whenever a callback
looks.
"""

import contextlib
from typing import NamedTuple

import jax

from keras_dp import _compat
from keras_dp.core import inflight
from keras_dp.core import interrupts
from keras_dp import sharding as mesh_lib


class TrainState(NamedTuple):
    """Everything a train step reads and replaces, as lists of arrays.

    Each list follows the order of the matching Keras attribute, so that
    `model.stateless_call` and `optimizer.stateless_apply` accept it as is.

    Attributes:
        trainable: `model.trainable_variables` values.
        non_trainable: `model.non_trainable_variables` values (BatchNorm
            moving statistics, Dropout's seed-generator state, ...).
        optimizer: `model.optimizer.variables` values (step count, slots).
        metrics: `model.metrics_variables` values (loss tracker, metrics).
    """

    trainable: list
    non_trainable: list
    optimizer: list
    metrics: list

    @classmethod
    def variables_of(cls, model):
        """The Keras variables behind each group, as a `TrainState` of lists.

        The one definition of what the training state is, for reading it
        (`from_model`, checkpoints) and writing it back.
        """
        return cls(
            trainable=model.trainable_variables,
            non_trainable=model.non_trainable_variables,
            optimizer=model.optimizer.variables,
            metrics=model.metrics_variables,
        )

    @classmethod
    def from_model(cls, model, mesh, shardings=None):
        """Copy a built, compiled model's variables onto the devices of `mesh`.

        Args:
            shardings: a `TrainState` of shardings (`keras_dp.layout`);
                default: every variable replicated.

        Returns:
            A `TrainState` whose leaves are fresh (never aliased with the
            Keras variables), laid out as `shardings`.
        """
        values = cls(*map(_values, cls.variables_of(model)))
        return mesh_lib.place(values, mesh, shardings or mesh_lib.replicated(mesh))

    @classmethod
    def abstract_of(cls, model, shardings):
        """The state `from_model` would place, as `jax.ShapeDtypeStruct`s: nothing placed.

        Each leaf has its variable's shape and dtype and its sharding from
        `shardings` (a `TrainState` of shardings, `keras_dp.layout`): what
        lowering a step or describing the state needs, at no device memory.
        """
        return jax.tree.map(
            lambda variable, sharding: jax.ShapeDtypeStruct(
                variable.shape, variable.dtype, sharding=sharding),
            cls.variables_of(model), shardings, is_leaf=lambda leaf: hasattr(leaf, "shape"))

    def groups(self):
        """Yield `(name, list_of_arrays)` for each state group."""
        return zip(self._fields, self)

    @property
    def weights(self):
        """`(trainable, non_trainable)`: all that inference reads."""
        return (self.trainable, self.non_trainable)


def write_back(state, model, variables=None):
    """Assign `state` to the Keras model's variables (`variables`, a `TrainState` of lists).

    Afterwards the model holds the trained values as ordinary Keras
    variables, placed where they were before: `model.predict`, `model.save`
    and the model's own `fit` work on it as if keras_dp had never run. The
    values are copied device to device (a state on one process's devices
    never goes through the host; one split across processes is gathered
    through the hosts), into new buffers, so donating `state` later leaves
    the model intact. `variables` (default: `TrainState.variables_of(model)`
    now) are the variables `state` was read from, when a layer's
    `trainable` may have moved one between groups since.
    """
    for group, values in zip(variables or TrainState.variables_of(model), state):
        if values is None:  # a group the caller does not write
            continue
        pairs = list(zip(group, values, strict=True))
        copies = mesh_lib.local_copies([value for _, value in pairs],
                                       [variable.value for variable, _ in pairs])
        for (variable, _), copy in zip(pairs, copies):
            variable.assign(copy)


def finalize_variable_values(model):
    """Keras's own end of fit (`use_ema`: the moving averages become the weights), unshared.

    `optimizer.finalize_variable_values` assigns each average variable to
    its weight, and Keras's `assign` stores the average's array itself, so
    the weight and the average then hold one buffer: Keras's next `predict`
    or `evaluate` donates the weight's buffer and deletes the average with
    it, and a `fit_sharded` after that fails ("Array has been deleted"), a
    `model.fit` too (as Keras's own `model.fit` twice does). Afterwards each
    of the model's variables owns its buffer (`own_buffers`), so any Keras
    or keras_dp call may follow.
    """
    model.optimizer.finalize_variable_values(model.trainable_weights)
    own_buffers(model)


def own_buffers(model):
    """Give a copy, made on the device, to each model variable whose buffer another holds.

    Every variable of the training state (`TrainState.variables_of`) is
    looked at once (a tied weight is one variable); the first holder of a
    buffer keeps it, each later one gets its own. Returns the paths of the
    variables given a copy.
    """
    seen, shared = set(), []
    variables = {id(variable): variable
                 for group in TrainState.variables_of(model) for variable in group}
    for variable in variables.values():
        buffers = _buffers(variable.value)
        if buffers & seen:
            shared.append(variable)
        seen |= buffers
    values = [variable.value for variable in shared]
    for variable, copy in zip(shared, mesh_lib.local_copies(values, values)):
        variable.assign(copy)
    return [variable.path for variable in shared]


def _buffers(value):
    """The device buffers of a live `jax.Array`, as `(device, address)` pairs (none otherwise)."""
    if not isinstance(value, jax.Array) or value.is_deleted():
        return set()
    return {(shard.device, shard.data.unsafe_buffer_pointer())
            for shard in value.addressable_shards}


def model_weights(model, mesh, shardings=None):
    """The model's `(trainable, non_trainable)` values on `mesh`.

    All that inference reads: unlike `TrainState.from_model`, this needs no
    built optimizer or metrics. `shardings` is a `TrainState` of shardings
    (its two weight groups are used); default: replicated.
    """
    weights = (_values(model.trainable_variables), _values(model.non_trainable_variables))
    layout = mesh_lib.replicated(mesh) if shardings is None else shardings.weights
    return mesh_lib.place(weights, mesh, layout)


def fresh_metrics(model, mesh, shardings=None):
    """Return the metric variables' reset values on `mesh` (`shardings`: a list).

    Reset values are the same in every process (Keras resets a metric to its
    initializer's constant), so across processes they are placed without a
    broadcast: starting an epoch costs no collective.
    """
    model.reset_metrics()
    return mesh_lib.place(_values(model.metrics_variables), mesh,
                          shardings or mesh_lib.replicated(mesh), same_on_every_process=True)


def is_alive(state):
    """Whether no array of `state` has been deleted (for example, donated)."""
    return not any(leaf.is_deleted() for leaf in jax.tree.leaves(state))


def check_usable(state, caller):
    """Refuse what a step or `write_back` cannot take, naming the fix.

    A donated state's arrays are deleted; JAX's dispatch of an already
    compiled step passes such a buffer on and can crash the process
    (measured: a segfault on XLA:CPU), so this is checked before the call.

    Raises:
        TypeError: `state` is not a `TrainState`.
        ValueError: an array of `state` is deleted (donated to a step).
    """
    if not isinstance(state, TrainState):
        raise TypeError(
            f"{caller} takes a keras_dp.TrainState, from trainer.init_state() or "
            f"returned by the previous train_step. Received: state of type "
            f"{type(state).__name__}. Call trainer.build(batch) and "
            f"state = trainer.init_state() first.")
    if not is_alive(state):
        raise ValueError(
            f"{caller} was given a state whose arrays are deleted: it was donated to "
            "an earlier train_step, which consumed it. Use the state that step "
            "returned: `state, logs = trainer.train_step(state, batch)`, or a new one "
            "from trainer.init_state().")


def _values(variables):
    return [variable.value for variable in variables]


class LiveModel:
    """The state of the epoch in progress, and the Keras model's view of it.

    While `attached`, the model's `jax_state_sync` is this object's `sync`.
    Keras's `Callback.model` calls it on the JAX backend before handing the
    model to a callback, so a callback that reads `self.model` mid-epoch gets
    the current weights; before the next step, `needs_read` then compares
    the model's arrays with those last exchanged (`touched`) and has the
    model read only if one changed, so that what a callback changed is
    trained on. A step costs no copy unless a callback looks.

    The state and the model are each labelled with their position, `(epoch,
    steps done in it)`: `position` for the live state, `model_position` for
    what the model holds (None until the first read). When the steps do not
    donate their state (`keep_last_good`), the newest state known to have
    completed is kept too (`inflight.LastGood`), and written back if a later
    step fails at run time.
    """

    def __init__(self, model, before_gather=None):
        self.model = model
        # Across processes with a split state: `before_gather(position)`, a
        # round that every process reading the model makes before the gather.
        self._before_gather = before_gather
        self._ungathered = None  # why the split state cannot be gathered here, if so
        self.state = None
        self.synced = True  # the model holds what `state` holds
        self.touched = False  # a callback has seen the model since the last read
        self.position = self.model_position = None
        self.lost = None  # why the live state could not be written back, if so
        self.kept = False  # the model got the last good state instead (`finish`)
        self._last_good = inflight.LastGood()
        self._exchanged = []  # the model's arrays when it last met `state`
        self._variables = None  # the model's variables `state` was read from (`read`)
        self._compiled = None  # the model's optimizer, loss and metrics at `read`
        self._interrupts = interrupts.Deferred()

    @contextlib.contextmanager
    def attached(self):
        """The span of a fit: the model's sync hook calls `sync`, SIGINT waits for hand-overs.

        Leaving the block, by any exit, writes the state back (`finish`)
        before SIGINT gets its usual handler again.
        """
        _compat.shadow_state_sync(self.model, self.sync)
        try:
            with self._interrupts:
                try:
                    yield self
                finally:
                    self.finish()
        finally:
            _compat.unshadow_state_sync(self.model)

    def read(self, state, position):
        """Take `state`, just read from the model (which is at `position`), as the live state.

        The variables it was read from are kept: `state` is written back
        into them even if a layer's `trainable` moves one to another group.
        """
        self._variables = self._state_variables()
        self._compiled = self._compiled_parts()
        self.state, self.synced, self.touched = state, True, False
        self.position = self.model_position = position
        self._exchanged = self._arrays()
        self._last_good.reset(state, position)

    def needs_read(self):
        """Whether the model must be read again before the next step.

        True when there is no live state, or when a callback has seen the
        model and changed one of its weights, non-trainable or optimizer
        variables since they last met the state (Keras's `assign` puts a
        new array in the variable, so comparing arrays by identity finds
        any change without a copy). A callback that only looked costs no
        read. Metric variables are not compared: the trainer resets them
        itself.
        """
        if self.state is None:
            return True
        changed = self.model_changed()
        self.touched = False
        return changed

    def model_changed(self):
        """Whether a callback changed the model since it met the state (`needs_read`, read only).

        A `model.compile` in a callback counts as a change: the read that
        follows refuses it (`ShardedTrainer.init_state`), at the next step.
        """
        return self.touched and (
            any(now is not then for now, then in zip(self._compiled_parts(), self._compiled))
            or any(now is not then for now, then in zip(self._arrays(), self._exchanged)))

    def _compiled_parts(self):
        """The objects `model.compile` replaces: the optimizer, compiled loss and metrics."""
        return (getattr(self.model, "optimizer", None), _compat.compiled_loss(self.model),
                _compat.compiled_metrics(self.model))

    def current(self, read, any_process=None):
        """The state the run is at: the live state, or the model's if a callback changed it.

        Writes nothing into the model, so a split state stays split. When a
        callback has changed the model since it met the state, the model is
        the truth: `read()` (the trainer's `init_state`) lays it out on the
        mesh, and it becomes the live state. Across processes, pass
        `any_process` (the placement's): every process then reads when any
        one must, as at an epoch's start, since reading is collective.
        """
        changed = self.model_changed()
        if any_process is not None:
            changed = any_process(changed)
            if changed:
                self.sync()  # process 0's model must hold its latest state
        if changed:
            self.read(read(), self.position)
        return self.state

    def _arrays(self):
        # Metric variables are left out: the trainer resets them itself.
        return [variable.value for variable in self._compared_variables()]

    def _compared_variables(self):
        """The variables whose change makes `needs_read` true."""
        variables = TrainState.variables_of(self.model)._replace(metrics=[])
        return [variable for group in variables for variable in group]

    def _state_variables(self):
        """The model's variables, as the groups of a state read from it now."""
        return TrainState(*map(list, TrainState.variables_of(self.model)))

    def _write(self, state):
        """Write `state` into the model (an ensemble writes every member)."""
        write_back(state, self.model, self._variables)

    def advance(self, call, position):
        """Run `call(state) -> (new_state, *rest)` on the live state; return `rest`.

        `call` may donate the live state, so its successor, at `position`,
        is recorded before a KeyboardInterrupt can be raised: SIGINT is held
        back from the call until the new state is stored. If `call` raises,
        the live state stays what it was (deleted if the call donated it).
        """
        with self._interrupts.held():
            self._last_good.confirm()  # drop what is no longer the last good, first
            given = self.state
            try:
                new_state, *rest = call(given)
            finally:  # failed or not, a call that donated left nothing to keep
                # A call donates all of its state or none of it: one leaf tells.
                if jax.tree.leaves(given)[0].is_deleted():
                    self._last_good.stop()
            self.stepped(new_state, position)
        return rest

    def stepped(self, state, position=None):
        """Take a step's new state (at `position`, default: unchanged); the model is behind it."""
        self.state, self.synced = state, False
        if position is not None:
            self.position = position
        self._last_good.dispatched(state, self.position)

    def tested(self, read, non_trainable, metrics, *, model_read, any_process=None):
        """Take the non-trainable and metric values a validation's test steps left.

        As after `model.fit`'s validation: they carry into the next epoch
        (a seed generator advanced in inference mode), and the metrics hold
        the validation's results until the epoch after resets them. The
        weights are the run's (`current(read, any_process)`). With
        `model_read` (a callback may read the model, through `self.model` or
        a closure), they are written into the model now: called before
        `on_test_end`, as Keras's evaluate gives them to the model, so that
        what a callback changes there is what the next epoch trains on.
        """
        self.stepped(self.current(read, any_process)._replace(non_trainable=non_trainable,
                                                              metrics=metrics))
        if model_read:
            self.sync()

    def sync(self):
        """Write the live state into the model if it is behind (Keras calls this).

        With `before_gather`, every process agrees first; if that fails,
        the state is not gathered by this process alone, now or at `finish`.
        """
        self.touched = True
        if not self.synced and self._before_gather is not None:
            try:
                self._before_gather(self.position)
            except BaseException:
                self._ungathered = ("the training state is split across processes and "
                                    "could not be gathered on this process alone")
                raise
        self.finish()

    def finish(self):
        """Write the state into the model if it is behind and known good; else say why not.

        Never when the model is in step: a callback may have changed it
        after the last step (ReduceLROnPlateau at the last epoch's end). A
        state that was donated to a step that then failed, or that holds a
        failed step's result, is not written: `lost` says which. The model
        then gets the last state that completed if the steps kept it
        (`kept`), else keeps what it held (`model_position` says which).
        """
        if self.synced:
            return
        if self._ungathered is not None:  # a collective of this process alone: never
            self.lost = self._ungathered
            return
        with self._interrupts.held():
            self.lost = _unusable(self.state)
            if self.lost is None:
                self._give_model(self.state, self.position)
                self.synced = True
                self._last_good.reset(self.state, self.position)
                return
            state, position = self._last_good.confirm(wait=True)
            if state is not None:
                self._give_model(state, position)
                self.kept = True
                self._last_good.stop()  # written once: nothing more to keep

    def _give_model(self, state, position):
        """Write `state`, at `position`, into the model and note what the model now holds."""
        self._write(state)
        self.model_position = position
        self._exchanged = self._arrays()

    def report(self):
        """A sentence for an error that ends fit: which step's weights the model holds."""
        if self.model_position is None:
            return "keras_dp: the model holds the weights it had before fit."
        epoch, steps = self.model_position
        held = f"the weights after {steps} steps of epoch {epoch + 1}"
        if self.lost is None or self.position == self.model_position:
            return f"keras_dp: the model holds {held}, the last step that completed."
        at_epoch, at_steps = self.position
        if self.kept:
            return (
                f"keras_dp: {self.lost}, so the model holds {held}, the last step "
                f"that completed; no completed step is lost (the steps after it, up "
                f"to {at_steps} steps of epoch {at_epoch + 1}, did not complete)."
            )
        return (
            f"keras_dp: {self.lost}, so the model holds {held}, the last state "
            f"written back to it; the steps completed after it, up to {at_steps} "
            f"steps of epoch {at_epoch + 1}, are lost."
        )


def _unusable(state):
    """Why `state` cannot be written back (donated, or a failed step's result), or None."""
    if not is_alive(state):
        return "the step that failed had consumed its input state (donated to it)"
    try:
        jax.block_until_ready(state)
    except Exception as error:  # noqa: BLE001 - any failure of the step that made it
        return f"the step that made the state failed ({type(error).__name__})"
    return None
