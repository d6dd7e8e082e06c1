"""Ensemble members: built from one recipe with their own seeds, stacked on devices.

Member `i` of an ensemble is `build_model()` called right after
`keras.utils.set_random_seed(seed + i)`. Its variables become row `i` of
arrays with a leading member axis, and that axis is split over the mesh axis
`"batch"` in contiguous blocks: with `M` members on `D` devices, device `d`
holds members `d*M/D` to `(d+1)*M/D - 1`.
"""

import numbers

import jax
import keras
import numpy as np

from keras_dp import _compat
from keras_dp import sharding
from keras_dp.checks import labels
from keras_dp.core.state import TrainState
from keras_dp.core.state import write_back
from keras_dp.keras import build


def member_mesh(members=None, mesh=None, devices=None):
    """Return `(M, mesh)`: the member count and the mesh its axis is split over.

    Args:
        members: the member count `M`; default: one per device.
        mesh, devices: as for `keras_dp.make_mesh` (default: all devices).

    Returns:
        With `M` at most the `D` devices, a mesh of the first `M` devices
        (one member each); with `M` a multiple of `D`, the whole mesh.

    Raises:
        ValueError: `M` is not a positive integer, or is above `D` and not
            a multiple of it; the mesh spans several processes; or a Keras
            distribution other than `DataParallel` is set.
    """
    build.check_keras_distribution()
    base = sharding.make_mesh(devices, mesh)
    if sharding.spans_processes(base):
        raise ValueError(
            "Ensembles train in one process: keras_dp places every member on "
            "this process's devices and scores them on its host. Received a "
            f"mesh over {len({d.process_index for d in base.devices.flat})} "
            "processes. Pass devices=jax.local_devices() to train an ensemble "
            "on each host's own devices, or train in one process."
        )
    available = list(base.devices.flat)
    n = len(available)
    count = n if members is None else members
    if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 1:
        raise ValueError(
            f"`members` must be a positive integer. Received: members={members!r}."
        )
    if count < n:
        return int(count), sharding.make_mesh(available[:count])
    if count % n:
        raise ValueError(
            f"{count} ensemble members do not fit {n} devices: every device "
            f"must hold the same number of members. Use at most {n} members "
            f"(one per device), or a multiple of {n} such as "
            f"{count - count % n} or {count + n - count % n}, or pass devices= "
            "with a device count that divides the member count."
        )
    return int(count), base


def member_sharded(mesh):
    """The sharding of stacked member arrays: the member axis split over `"batch"`.

    It is the sharding keras_dp gives batch rows, applied to members.
    """
    return sharding.Layout(mesh).batch


def describe_placement(mesh, count):
    """Describe where `count` members sit on `mesh`, as two lines of text."""
    devices = list(mesh.devices.flat)
    k = count // len(devices)
    placement = " | ".join(
        f"{device.platform}:{device.id}: "
        + (f"member {d}" if k == 1 else f"members {d * k}-{d * k + k - 1}")
        for d, device in enumerate(devices)
    )
    return (
        f"Ensemble: {count} member(s) on {len(devices)} device(s) along axis "
        f"{sharding.BATCH_AXIS!r}, {k} per device\n  {placement}"
    )


def make_members(build_model, count, seed):
    """Build `count` compiled models, member `i` under seed `seed + i`.

    Args:
        build_model: a function of no arguments that returns a new compiled
            `keras.Model` on every call, or a `keras.Model`, which is cloned
            (`keras.models.clone_model`: same layers, fresh weights) and
            compiled from its compile config.
        count: the number of members.
        seed: member `i` is built right after
            `keras.utils.set_random_seed(seed + i)`, which also reseeds
            Python's and numpy's global generators.

    Returns:
        The list of models, renamed `member_0`, `member_1`, ... (the
        averaging model needs distinct sub-model names).

    Raises:
        TypeError: `build_model` is neither callable nor a model, or
            returned something that is not a `keras.Model`.
        ValueError: an uncompiled model, the same model object twice, or
            a model to clone that Keras cannot rebuild from its config.
    """
    models = []
    for index in range(count):
        model = _make_member(build_model, seed + index, index)
        if any(model is other for other in models):
            raise ValueError(
                "build_model returned the same model object twice; each member "
                "needs its own. Create the model inside build_model, on every "
                "call (or pass one model to be cloned)."
            )
        model.name = f"member_{index}"
        models.append(model)
    return models


def stack_state(models, mesh, groups=TrainState._fields):
    """Read the models' variables and stack them on a member axis on `mesh`.

    Args:
        models: built models of one architecture.
        mesh: the mesh the member axis is split over.
        groups: the `TrainState` fields to read; the others are `None`.

    Returns:
        A `TrainState` of fresh arrays (never aliased with a Keras variable,
        so donating them is safe) of shape `(M, *variable.shape)`, placed
        with `member_sharded(mesh)`.

    Raises:
        ValueError: the models' variables differ in number, shape or dtype.
    """
    per_member = [_host_state(model, groups) for model in models]
    layout = [jax.tree.map(lambda v: (v.shape, str(v.dtype)), s) for s in per_member]
    for index, other in enumerate(layout[1:], start=1):
        if other != layout[0]:
            raise ValueError(
                f"Member {index}'s variables differ from member 0's in number, "
                "shape or dtype. build_model must return the same architecture "
                "and optimizer on every call; only the initial values may differ."
            )
    stacked = jax.tree.map(lambda *values: np.stack(values), *per_member)
    return jax.device_put(stacked, member_sharded(mesh))


def write_back_members(state, models):
    """Assign row `i` of every array of a stacked `state` to `models[i]`."""
    host = jax.device_get(state)
    for index, model in enumerate(models):
        # state.write_back reads device arrays: give it one-device copies.
        write_back(jax.tree.map(lambda value: jax.device_put(value[index]), host), model)


def averaging_model(models, from_logits, x_example):
    """Return a Functional model that outputs the mean of the models' probabilities.

    Args:
        models: the members; they become sub-models and share their weights.
        from_logits: apply a `Softmax` layer to each member's output first.
        x_example: host data `x`; its shapes and dtypes declare the inputs
            when member 0 declares none (a subclassed model).

    Returns:
        An uncompiled `keras.Model` named `ensemble`: one input like member
        0's, each member (then its softmax), and an `Average` layer named
        `mean_probabilities`. It saves and loads as a `.keras` file.
    """
    declared = getattr(models[0], "inputs", None)
    if declared:
        template = declared[0] if len(declared) == 1 else models[0].input
    else:
        template = x_example
    def input_like(spec, name=None):
        return keras.Input(shape=spec.shape[1:], dtype=spec.dtype, name=name)

    if isinstance(template, dict):  # Keras wants each input named as its key
        inputs = {key: input_like(spec, key) for key, spec in template.items()}
    else:
        inputs = keras.tree.map_structure(input_like, template)
    outputs = []
    for index, model in enumerate(models):
        output = model(inputs)
        if from_logits:
            output = keras.layers.Softmax(name=f"member_{index}_softmax")(output)
        outputs.append(output)
    if len(outputs) == 1:  # Average needs two inputs or more.
        return keras.Model(inputs, outputs[0], name="ensemble")
    mean = keras.layers.Average(name="mean_probabilities")(outputs)
    return keras.Model(inputs, mean, name="ensemble")


def read_from_logits(model, from_logits=None):
    """Whether the members output logits: `from_logits`, else read from the loss.

    A compiled loss object with a `from_logits` setting decides; a loss
    given by name or as a Keras function means probabilities (Keras's
    default). Any other loss needs an explicit answer.

    Raises:
        ValueError: `from_logits` is `None` and the loss does not tell.
    """
    if from_logits is not None:
        return bool(from_logits)
    loss = model.loss
    if isinstance(loss, keras.losses.Loss) and "from_logits" in loss.get_config():
        return bool(loss.get_config()["from_logits"])
    if isinstance(loss, str) or labels.keras_loss_function(loss) is not None:
        return False
    raise ValueError(
        "Cannot tell from the compiled loss whether the models output logits "
        f"or probabilities. Received: loss={loss!r}. Pass from_logits=True "
        "(a softmax is applied before averaging) or from_logits=False."
    )


# Keras's losses over class probabilities; any other Keras loss (regression,
# binary, hinge) trains members whose outputs are not a class distribution.
_CLASS_LOSSES = frozenset({
    "categorical_crossentropy", "sparse_categorical_crossentropy",
    "categorical_focal_crossentropy", "kl_divergence",
})


def check_classifier(model):
    """Refuse a member compiled with a Keras loss that is not a multi-class one.

    The ensemble averages class probabilities and scores them by categorical
    cross-entropy and accuracy, which mean nothing for a regression or a
    one-unit binary output. A loss of the user's own passes.

    Raises:
        ValueError: the compiled loss is one of Keras's losses other than
            categorical, sparse categorical, focal categorical
            cross-entropy or KL divergence.
    """
    function = labels.keras_loss_function(model.loss)
    if function is not None and function.__name__ not in _CLASS_LOSSES:
        raise ValueError(
            "fit_ensemble trains multi-class classifiers: it averages the "
            "members' class probabilities and scores them by cross-entropy and "
            f"accuracy. Received a model compiled with loss={model.loss!r}. "
            "Compile each member with a softmax (or logits) output of one unit "
            "per class and loss='sparse_categorical_crossentropy' or "
            "'categorical_crossentropy' (a binary task: 2 units)."
        )


def check_class_output(model, x):
    """Refuse a member whose output on `x` is not one tensor of 2 or more classes.

    Raises:
        ValueError: the output is a structure, or its last axis has fewer
            than 2 classes.
    """
    spec = jax.tree.map(
        lambda a: keras.KerasTensor((None, *np.shape(a)[1:]), np.asarray(a).dtype), x)
    output = model.compute_output_spec(spec)
    if not isinstance(output, keras.KerasTensor) or len(output.shape) < 2 or (
            output.shape[-1] is not None and output.shape[-1] < 2):
        shape = jax.tree.map(lambda o: tuple(o.shape), output)
        raise ValueError(
            "fit_ensemble averages class probabilities, so each member must "
            "output one tensor of shape (batch, classes) with 2 or more "
            f"classes. Received an output of shape {shape}. For a binary task "
            "use Dense(2) with a softmax (or logits) and "
            "loss='sparse_categorical_crossentropy'."
        )


def _make_member(build_model, seed, index):
    _compat.set_random_seed(seed)  # Keras's, without importing TensorFlow
    if isinstance(build_model, keras.Model):
        model = _clone(build_model)
    elif callable(build_model):
        model = build_model()
    else:
        raise TypeError(
            "build_model must be a function that returns a new compiled "
            "keras.Model, or a keras.Model to clone. Received an object of "
            f"type {type(build_model).__name__}."
        )
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"build_model must return a keras.Model. For member {index} it "
            f"returned an object of type {type(model).__module__}."
            f"{type(model).__qualname__}. Return a compiled keras.Sequential"
            "([...]) or keras.Model(inputs, outputs)."
        )
    if not model.compiled:
        if isinstance(build_model, keras.Model):  # cloned: its compile config is copied
            raise ValueError(
                "The model passed to be cloned for each member is not compiled. "
                "Call model.compile(optimizer=..., loss=..., metrics=[...]) on it "
                "first: each member is compiled from its compile config."
            )
        raise ValueError(
            f"build_model returned an uncompiled model (member {index}). Call "
            "model.compile(optimizer=..., loss=..., metrics=[...]) inside "
            "build_model before returning the model."
        )
    return model


def _clone(model):
    """`model` cloned with fresh weights and compiled from its compile config.

    Raises:
        ValueError: a layer, loss, metric or optimizer of `model` cannot be
            rebuilt from its config (a custom class without `get_config`,
            or not registered), naming Keras's reason and the fix.
    """
    try:
        clone = keras.models.clone_model(model)
        if model.compiled:
            clone.compile_from_config(model.get_compile_config())
    except Exception as error:
        reason = " ".join(str(error).split()) or type(error).__name__
        reason = reason if len(reason) <= 400 else reason[:400] + " ..."
        raise ValueError(
            "fit_ensemble clones the model it is given for each member "
            "(keras.models.clone_model, then compile from its compile config), "
            f"and {model.name!r} cannot be cloned. Keras reported: {reason} Pass a "
            "function that builds and compiles a new model instead, "
            "fit_ensemble(build_model, ...) with def build_model(): ...; "
            "model.compile(...); return model, or make the custom objects "
            "serializable (a get_config() that returns their __init__ "
            "arguments, and @keras.saving.register_keras_serializable())."
        ) from error
    return clone


def _host_state(model, groups):
    return TrainState(*(
        [np.asarray(v.value) for v in variables] if name in groups else None
        for name, variables in TrainState.variables_of(model).groups()
    ))
