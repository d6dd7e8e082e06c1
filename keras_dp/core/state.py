"""The training state and its boundaries with the Keras model.

`TrainState` is the one definition of what a train step reads and replaces.
`TrainState.from_model` reads a built, compiled Keras model into device
arrays (replicated, or split as `keras_dp.sharding.Layout` says;
`keras_dp.transfer.place` copies them there); `write_back` is the only code in keras_dp that assigns
to Keras variables (`keras_dp.transfer.local_copies` gives it buffers of
their own). In
between, the state lives only in the compiled steps, which take it and
return its successor. During `fit`, `keras_dp.core.live.LiveModel` holds
the state of the epoch in progress.
"""

from typing import NamedTuple

import jax

from keras_dp import sharding
from keras_dp.transfer import local_copies
from keras_dp.transfer import place


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
        return place(values, mesh, shardings or sharding.replicated(mesh))

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


def write_back(state, model, variables=None, owned=False):
    """Assign `state` to the Keras model's variables (`variables`, a `TrainState` of lists).

    Afterwards the model holds the trained values as ordinary Keras
    variables, placed where they were before: `model.predict`, `model.save`
    and the model's own `fit` work on it as if keras_dp had never run. The
    values are copied device to device (a state on one process's devices
    never goes through the host; one split across processes is gathered
    through the hosts), into new buffers, so donating `state` later leaves
    the model intact. `variables` (default: `TrainState.variables_of(model)`
    now) are the variables `state` was read from, when a layer's
    `trainable` may have moved one between groups since. `owned`: the
    arrays are already laid out as the variables and held by nothing else
    (fresh from a checkpoint), so each is assigned as it is, with no copy:
    device 0 then never holds more than the old state and the new.
    """
    for group, values in zip(variables or TrainState.variables_of(model), state):
        if values is None:  # a group the caller does not write
            continue
        pairs = list(zip(group, values, strict=True))
        copies = [value for _, value in pairs] if owned else local_copies(
            [value for _, value in pairs], [variable.value for variable, _ in pairs])
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
    for variable, copy in zip(shared, local_copies(values, values)):
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
    layout = sharding.replicated(mesh) if shardings is None else shardings.weights
    return place(weights, mesh, layout)


def fresh_metrics(model, mesh, shardings=None, reset=True):
    """Return the metric variables' reset values on `mesh` (`shardings`: a list).

    `model.reset_metrics()` resets them first, unless `reset=False` says
    the caller has just done so (Keras calls it once per epoch and once per
    evaluation, and a model may count its calls or a metric skip them).
    Reset values are the same in every process (Keras resets a metric to
    its initializer's constant), so across processes they are placed
    without a broadcast: starting an epoch costs no collective.
    """
    if reset:
        model.reset_metrics()
    return place(_values(model.metrics_variables), mesh,
                          shardings or sharding.replicated(mesh), same_on_every_process=True)


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


