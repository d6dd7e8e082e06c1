"""The training state and its two boundaries with the Keras model.

`TrainState.from_model` reads a built, compiled Keras model into replicated
device arrays; `write_back` is the only code in keras_dp that assigns to Keras
variables. In between, the state lives only in the compiled steps, which take
it and return its successor.
"""

from typing import NamedTuple

import jax

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
    def from_model(cls, model, mesh):
        """Copy a built, compiled model's variables onto every device of `mesh`.

        Returns:
            A `TrainState` whose leaves are fresh (never aliased with the
            Keras variables) and replicated over `mesh`.
        """
        return mesh_lib.replicate(cls(*map(_values, cls.variables_of(model))), mesh)

    def groups(self):
        """Yield `(name, list_of_arrays)` for each state group."""
        return zip(self._fields, self)


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
        for variable, value in zip(group, values, strict=True):
            variable.assign(mesh_lib.local_copy(value, like=variable.value))


def model_weights(model, mesh):
    """The model's `(trainable, non_trainable)` values, replicated over `mesh`.

    All that inference reads: unlike `TrainState.from_model`, this needs no
    built optimizer or metrics.
    """
    return mesh_lib.replicate(
        (_values(model.trainable_variables), _values(model.non_trainable_variables)),
        mesh,
    )


def fresh_metrics(model, mesh):
    """Return the metric variables' reset values, replicated over `mesh`."""
    model.reset_metrics()
    return mesh_lib.replicate(_values(model.metrics_variables), mesh)


def is_alive(state):
    """Whether no array of `state` has been deleted (for example, donated)."""
    return not any(leaf.is_deleted() for leaf in jax.tree.leaves(state))


def _values(variables):
    return [variable.value for variable in variables]
