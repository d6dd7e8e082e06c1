"""The training state and its boundaries with the Keras model.

`TrainState` is the one definition of what a train step reads and replaces.
`TrainState.from_model` reads a built, compiled Keras model into replicated
device arrays; `write_back` is the only code in keras_dp that assigns to
Keras variables. In between, the state lives only in the compiled steps,
which take it and return its successor. During `fit`, `LiveModel` holds the
state of the epoch in progress and keeps the Keras model in step with it
whenever a callback looks.
"""

import contextlib
from typing import NamedTuple

import jax

from keras_dp import _compat
from keras_dp import mesh as mesh_lib


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

    def groups(self):
        """Yield `(name, list_of_arrays)` for each state group."""
        return zip(self._fields, self)

    @property
    def weights(self):
        """`(trainable, non_trainable)`: all that inference reads."""
        return (self.trainable, self.non_trainable)


def write_back(state, model):
    """Assign `state` to the Keras model's variables.

    Afterwards the model holds the trained values as ordinary Keras
    variables, placed where they were before: `model.predict`, `model.save`
    and the model's own `fit` work on it as if keras_dp had never run. The
    values are copied device to device (a state this size never goes
    through the host), into new buffers, so donating `state` later leaves
    the model intact.
    """
    for group, values in zip(TrainState.variables_of(model), state):
        if values is None:  # a group the caller does not write
            continue
        for variable, value in zip(group, values, strict=True):
            variable.assign(mesh_lib.local_copy(value, like=variable.value))


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
    """Return the metric variables' reset values on `mesh` (`shardings`: a list)."""
    model.reset_metrics()
    return mesh_lib.place(_values(model.metrics_variables), mesh,
                          shardings or mesh_lib.replicated(mesh))


def is_alive(state):
    """Whether no array of `state` has been deleted (for example, donated)."""
    return not any(leaf.is_deleted() for leaf in jax.tree.leaves(state))


def _values(variables):
    return [variable.value for variable in variables]


class LiveModel:
    """The state of the epoch in progress, and the Keras model's view of it.

    While `attached`, the model's `jax_state_sync` is this object's `sync`.
    Keras's `Callback.model` calls it on the JAX backend before handing the
    model to a callback, so a callback that reads `self.model` mid-epoch gets
    the current weights; `touched` then tells the trainer to read the model
    again before the next step, so that what the callback changed is trained
    on. A step costs no copy unless a callback looks.
    """

    def __init__(self, model):
        self.model = model
        self.state = None
        self.synced = True  # the model holds what `state` holds
        self.touched = False  # a callback has seen the model since the last read
        self._exchanged = []  # the model's arrays when it last met `state`

    @contextlib.contextmanager
    def attached(self):
        """While in this block, Keras's sync hook on the model calls `sync`."""
        _compat.shadow_state_sync(self.model, self.sync)
        try:
            yield self
        finally:
            _compat.unshadow_state_sync(self.model)

    def read(self, state):
        """Take `state`, just read from the model, as the live state."""
        self.state, self.synced, self.touched = state, True, False
        self._exchanged = self._arrays()

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
        if not self.touched:
            return False
        self.touched = False
        return any(now is not then for now, then in zip(self._arrays(), self._exchanged))

    def _arrays(self):
        # Metric variables are left out: the trainer resets them itself.
        return [variable.value for variable in self._compared_variables()]

    def _compared_variables(self):
        """The variables whose change makes `needs_read` true."""
        variables = TrainState.variables_of(self.model)._replace(metrics=[])
        return [variable for group in variables for variable in group]

    def _write(self, state):
        """Write `state` into the model (an ensemble writes every member)."""
        write_back(state, self.model)

    def stepped(self, state):
        """Take a step's new state; the model is now behind it."""
        self.state, self.synced = state, False

    def sync(self):
        """Write the live state into the model if it is behind (Keras calls this)."""
        self.touched = True
        if not self.synced:
            self.write_back_if_alive()

    def finish(self):
        """At the end of fit: write the state into the model if it is behind.

        Never when the model is in step: a callback may have changed it
        after the last step (ReduceLROnPlateau at the last epoch's end).
        """
        if not self.synced:
            self.write_back_if_alive()

    def write_back_if_alive(self):
        """Write the live state into the model unless it was donated away."""
        # A step that failed after its state was donated leaves nothing to
        # write; the model then keeps the weights of the last epoch boundary.
        if self.state is not None and is_alive(self.state):
            self._write(self.state)
            self.synced = True
            self._exchanged = self._arrays()
