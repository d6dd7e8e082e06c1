"""Keras's own description of a mesh with a model axis, read into a `keras_dp.sharding.Layout`.

keras_dp takes a `keras.distribution.ModelParallel` (its `DeviceMesh`,
`LayoutMap` and `batch_dim_name`) or a `DataParallel` as Keras's `fit`
does: passed as `distribution=`, or active when the trainer is made
(`keras.distribution.set_distribution`, `with distribution.scope():`). The
trainer then trains on the distribution's own mesh
(`device_mesh.backend_mesh`, so the variables Keras laid out need no copy),
splits each batch over its `batch_dim_name` axis as keras_dp always does
(unevenly where it must: no padding reaches a result), and lays each
variable out where Keras would (`VariableLayouts`): its own layout if it
was created under this distribution, else the layout map's entry for its
path; an optimizer slot as the weight it belongs to. `state_sharding` then
splits what the map leaves whole over the batch axis too
(`keras_dp.sharding`).

Nothing is silent: a layout map key that matches no variable and no layer
output, the largest weights the map leaves replicated, and variables laid
out by another distribution are reported as a `LayoutWarning` (make it an
error with `warnings.simplefilter("error", keras_dp.LayoutWarning)`); a
layout that does not divide its dimension is refused, naming the variable.
"""

import contextlib

import keras
import numpy as np
from jax.sharding import AxisType
from jax.sharding import Mesh
from jax.sharding import PartitionSpec

from keras_dp import _compat
from keras_dp import sharding
from keras_dp._messages import first_few
from keras_dp._messages import warn

# The most replicated weights a report names (largest first).
NAMED = 5
_HOW_STRICT = ("Make this an error with "
               "warnings.simplefilter('error', keras_dp.LayoutWarning).")
# The model's state groups, in the order of `TrainState` (`_state_group`).
_GROUPS = ("trainable", "non_trainable", "optimizer", "metrics")


class LayoutWarning(UserWarning):
    """A Keras layout that may not do what was meant, found before training.

    A `LayoutMap` key that matches no variable and no layer output (a typo
    leaves what it meant to split replicated), the largest weights left
    whole on every device under a `ModelParallel` distribution, or
    variables laid out by a distribution other than the trainer's. Turn it
    into an error with `warnings.simplefilter("error", keras_dp.LayoutWarning)`.
    """


def distribution_of(distribution, mesh, devices):
    """The Keras distribution a trainer trains under, or None for keras_dp's own 1-D mesh.

    `distribution` if given; else the one active now (set, or a scope
    entered), unless `mesh` or `devices` are given and it is a
    `DataParallel` (whose layout is keras_dp's own: those devices win).

    Raises:
        ValueError: `distribution` together with `mesh` or `devices`; a
            `ModelParallel` active while `mesh` or `devices` are given; a
            distribution that is neither `DataParallel` nor `ModelParallel`.
    """
    given = [name for name, value in (("mesh", mesh), ("devices", devices)) if value is not None]
    if distribution is not None and given:
        raise ValueError(
            f"Pass either `distribution` or `{given[0]}`, not both: a Keras "
            f"distribution brings its own device mesh. Received: distribution="
            f"{type(distribution).__name__}, {given[0]}=... Drop `{given[0]}`.")
    if distribution is None:
        distribution = keras.distribution.distribution()
        if distribution is None or (given and _is_data_parallel(distribution)):
            return None
        if given:
            raise ValueError(
                f"A {type(distribution).__name__} distribution is active (set with "
                "keras.distribution.set_distribution() or entered with `with "
                f"distribution.scope():`), and `{given[0]}` was given: the "
                "distribution's device mesh decides where a model split over its "
                f"axes trains. Drop `{given[0]}` to train on that mesh, or call "
                "keras_dp after keras.distribution.set_distribution(None) (outside "
                "the scope) to train whole copies of the model on the devices given "
                "(with state_sharding='full' if its variables must be split to fit).")
    if not isinstance(distribution, (keras.distribution.DataParallel,
                                     keras.distribution.ModelParallel)):
        raise ValueError(
            "keras_dp trains under a keras.distribution.ModelParallel or DataParallel. "
            f"Received: a {type(distribution).__name__}. Describe its layout as a "
            "ModelParallel(layout_map=..., batch_dim_name=...).")
    return distribution


def layout_of(model, distribution, state_sharding):
    """The `sharding.Layout` of training `model` under a Keras `distribution`.

    On the distribution's mesh, its rows split over `batch_dim_name`; under
    a `ModelParallel`, with the bases of `VariableLayouts`.

    Raises:
        ValueError: the batch axis is not an axis of the mesh; or a
            `ModelParallel`'s mesh spans processes.
    """
    mesh = _auto_axes(distribution.device_mesh.backend_mesh)
    batch_axis = distribution.batch_dim_name
    if batch_axis not in mesh.axis_names:
        raise ValueError(
            f"The distribution's batch_dim_name {batch_axis!r} is not an axis of its "
            f"device mesh {dict(mesh.shape)}. Pass batch_dim_name= one of "
            f"{list(mesh.axis_names)}: the axis each batch's rows split over.")
    if isinstance(distribution, keras.distribution.ModelParallel) and (
            sharding.spans_processes(mesh)):
        raise ValueError(
            "keras_dp trains under a ModelParallel distribution within one process "
            "only: across processes each process would own a slice of the batch axis "
            "with every device of the other axes, which is not tested yet. Received a "
            f"mesh {dict(mesh.shape)} over "
            f"{len({device.process_index for device in mesh.devices.flat})} processes. "
            "Train it in one process, or across processes with keras_dp's own mesh "
            "and state_sharding='full' (no distribution).")
    bases = None
    if isinstance(distribution, keras.distribution.ModelParallel):
        bases = VariableLayouts(model, distribution, mesh)
    return sharding.Layout(mesh, sharding.check_mode(state_sharding), batch_axis, bases)


def check_current(expected):
    """Refuse a Keras distribution active now that the trainer was not made with.

    Accepted: none; `expected` itself; a `DataParallel` unless `expected`
    is a `ModelParallel` (its layout is keras_dp's own). Checked whenever a
    trainer builds the model or runs a step: a distribution set since would
    lay out the variables the build creates and add its constraints to the
    step's trace.

    Raises:
        ValueError: another distribution is active.
    """
    current = keras.distribution.distribution()
    if current is None or current is expected or (
            _is_data_parallel(current) and not isinstance(
                expected, keras.distribution.ModelParallel)):
        return
    made = ("no Keras distribution" if expected is None
            else f"another {type(expected).__name__}")
    raise ValueError(
        f"A {type(current).__name__} distribution is active (set with "
        "keras.distribution.set_distribution() or entered with `with "
        f"distribution.scope():`), and this trainer was made with {made}: the model "
        "would be built in its layouts and the steps traced under its constraints. "
        "Make the trainer while it is active, or pass it as distribution=...; or call "
        "keras_dp outside it, after keras.distribution.set_distribution(None).")


def report(layout, model):
    """Warn (`LayoutWarning`) of what a layout may not do as meant, once the model is built.

    Under a `ModelParallel` (`layout.bases`): layout map keys matching no
    variable and no layer output, and the largest weights left replicated
    (`NAMED` of them, floating-point ones of at least
    `sharding.MIN_SPLIT_SIZE` elements); and variables that carried
    another distribution's layout. Without one: weights created split by
    a Keras distribution no longer active, which keras_dp trains whole.
    """
    if layout.bases is None:
        split = [variable.path for variable in model.variables
                 if _splits(_compat.variable_layout(variable))]
        if split:
            warn(f"keras_dp: {len(split)} of the model's variables were created split by "
                 f"a Keras distribution that is not active now ({first_few(split)}); "
                 "keras_dp trains them whole on every device of its own mesh. Pass "
                 "distribution=... (the one they were created under) to keep their "
                 f"layout. {_HOW_STRICT}", LayoutWarning)
        return
    layout.bases.report(layout)


class VariableLayouts:
    """Where a `ModelParallel` distribution puts each of a model's variables: `sharding.Layout.bases`.

    A variable's base `PartitionSpec` is its own layout (`_layout`, set
    when Keras created it under this distribution), or the layout map's
    entry for its path where it has none or one on another mesh, else
    replicated; an optimizer slot takes the base of the weight it was made
    for (Keras names it `<weight path>_<slot>`), as Keras lays slots out.
    Computed from the model's variables when asked, by position in each
    state group, and cached while the groups hold the same variables.

    Args:
        model: the Keras model.
        distribution: a `keras.distribution.ModelParallel`.
        mesh: its `jax.sharding.Mesh`.
    """

    def __init__(self, model, distribution, mesh):
        self.model, self.distribution, self.mesh = model, distribution, mesh
        self._cache = {}
        self._relaid = {}  # path -> its own layout's mesh axes, laid out by the map instead
        self._reported = False

    def scope(self):
        """The distribution's scope: where the model is built and the steps traced."""
        return self.distribution.scope()

    def specs(self, group, count):
        """The base `PartitionSpec`s of state group `group` (its `count` variables, in order).

        Raises:
            ValueError: a layout splits a dimension that its mesh axes do
                not divide, or names an axis the mesh does not have.
        """
        variables = _state_group(self.model, group)
        if len(variables) != count:
            raise ValueError(
                f"The model's {group} variables are {len(variables)}, and the state "
                f"has {count}: the model changed since the state was read. Call "
                "trainer.init_state() again.")
        key = (group, tuple(map(id, variables)))
        if key not in self._cache:
            if group == "optimizer":
                specs = self._slot_specs(variables)
            else:
                specs = [self._own_spec(variable) for variable in variables]
            for variable, spec in zip(variables, specs):
                self._check(variable, spec)
            self._cache[key] = specs
        return self._cache[key]

    def _own_spec(self, variable):
        """A model variable's base: its own layout on this mesh, else the layout map's."""
        own = _compat.variable_layout(variable)
        if own is not None and own.device_mesh is not None and _same_mesh(
                own.device_mesh.backend_mesh, self.mesh):
            return _spec(own.axes)
        if own is not None:
            self._relaid[variable.path] = own
        found = self.distribution.get_tensor_layout(variable.path)
        return None if found is None else _spec(found.axes)

    def _slot_specs(self, slots):
        """The optimizer's variables' bases: each slot its weight's, the rest their own."""
        optimizer = self.model.optimizer
        weights = _compat.optimizer_trainable_variables(optimizer) if optimizer.built else []
        prefixes = sorted(((_compat.slot_prefix(weight), weight) for weight in weights),
                          key=lambda pair: -len(pair[0]))
        specs = []
        for slot in slots:
            owner = next((weight for prefix, weight in prefixes
                          if slot.name.startswith(prefix) and weight.shape == slot.shape), None)
            specs.append(self._own_spec(slot if owner is None else owner))
        return specs

    def _check(self, variable, spec):
        if spec is None:
            return
        unknown = [axis for axis in sharding.axes_of(spec) if axis not in self.mesh.axis_names]
        bad = sharding.indivisible(self.mesh, variable.shape, spec) if not unknown else None
        if unknown or bad:
            dim, axes, parts = bad or (None, unknown, None)
            what = (f"names the axes {unknown}, which the mesh {dict(self.mesh.shape)} does "
                    "not have" if unknown else
                    f"splits dimension {dim} over {axes} ({parts} parts), which does not "
                    f"divide its size" + (f" {variable.shape[dim]}" if dim < len(
                        variable.shape) else f": the variable has {len(variable.shape)}"))
            raise ValueError(
                f"The layout {tuple(spec)} of {variable.path} (shape {tuple(variable.shape)}) "
                f"{what}. JAX splits a dimension only evenly. Change the layout map's "
                "entry for this variable (None leaves a dimension whole), or use a mesh "
                "whose axes divide it (a Gemma with 1 key-value head cannot split its "
                "key and value kernels over a model axis of 2).")

    def report(self, layout):
        """Warn once of unmatched layout map keys, large replicated weights, re-laid variables."""
        if self._reported:
            return
        self._reported = True
        shardings = {group: layout.group_shardings(_state_group(self.model, group), group)
                     for group in _GROUPS}
        unmatched = self._unmatched_keys()
        if unmatched:
            paths = [variable.path for variable in self.model.weights]
            warn(f"keras_dp: the layout map's key(s) {unmatched} match no variable of the "
                 "model and no layer output, so what they were meant to split stays "
                 f"replicated. The model's variable paths are {first_few(paths, 'paths ')}; "
                 "Keras matches each key to a path with re.fullmatch. Fix or delete "
                 f"the key(s). {_HOW_STRICT}", LayoutWarning)
        whole = self._largest_replicated(shardings)
        if whole:
            warn(f"keras_dp: the layout map leaves {len(whole)} large weight(s) whole on "
                 f"every device: {first_few(whole[:NAMED], limit=NAMED)}. Add a layout map "
                 "key for them, or split them over the batch axis with "
                 f"state_sharding='full'. {_HOW_STRICT}", LayoutWarning)
        if self._relaid:
            warn(f"keras_dp: {len(self._relaid)} variable(s) carried the layout of another "
                 f"distribution (they were created under it): {first_few(list(self._relaid))}. "
                 "keras_dp lays them out as this distribution's layout map says. "
                 f"{_HOW_STRICT}", LayoutWarning)

    def _unmatched_keys(self):
        """The layout map's keys that no variable path and no layer output path resolves to."""
        layout_map = _compat.layout_map(self.distribution)
        paths = [variable.path for group in _GROUPS for variable in _state_group(self.model, group)]
        paths += [f"{layer.path}/output" for layer in _compat.all_layers(self.model)]
        used = set()
        for path in paths:
            with contextlib.suppress(ValueError):  # several keys match: Keras says so itself
                used.add(id(layout_map[path]))
        return [key for key in layout_map if id(layout_map[key]) not in used]

    def _largest_replicated(self, shardings):
        """The weights left replicated that `state_sharding` would split, largest first, as text."""
        found = []
        for group in ("trainable", "non_trainable"):
            for variable, placed in zip(_state_group(self.model, group), shardings[group]):
                size = int(np.prod(variable.shape, dtype=np.int64))
                if (placed.is_fully_replicated and size >= sharding.MIN_SPLIT_SIZE
                        and "float" in str(variable.dtype)):
                    nbytes = size * np.dtype(variable.dtype).itemsize
                    found.append((nbytes, f"{variable.path} {tuple(variable.shape)}"))
        return [text for _, text in sorted(found, key=lambda pair: -pair[0])]


def _state_group(model, group):
    """The model's variables of one state group, in the order of `TrainState`."""
    if group == "optimizer":
        return list(model.optimizer.variables) if getattr(model, "optimizer", None) else []
    return list({"trainable": model.trainable_variables,
                 "non_trainable": model.non_trainable_variables,
                 "metrics": model.metrics_variables}[group])


def _spec(axes):
    """A `PartitionSpec` from a `TensorLayout`'s axes (None where it splits nothing)."""
    axes = tuple(axes)
    return None if not any(axes) else PartitionSpec(*axes)


def _splits(layout):
    """Whether a Keras `TensorLayout` (or None) splits anything."""
    return layout is not None and any(layout.axes)


def _is_data_parallel(distribution):
    return isinstance(distribution, keras.distribution.DataParallel)


def _same_mesh(a, b):
    """Whether two meshes have the same axes over the same devices in the same order."""
    return (tuple(a.axis_names) == tuple(b.axis_names) and a.devices.shape == b.devices.shape
            and all(x == y for x, y in zip(a.devices.flat, b.devices.flat)))


def _auto_axes(mesh):
    """`mesh`, or the same devices and axes as `Auto` axes (Keras's Dropout fails under `Explicit`)."""
    auto = (AxisType.Auto,) * len(mesh.axis_names)
    if tuple(mesh.axis_types) == auto:
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=auto)


def sharded_birth():
    """A context in which a split Keras variable is never whole on one device.

    Use it with a Keras distribution's scope where your model's weights
    are created, loaded or set::

        with distribution.scope(), keras_dp.sharded_birth():
            model = make_model()              # each split variable made in parts
            model.load_weights("model.weights.h5")   # read slice by slice

    Within it, a variable whose layout (a `ModelParallel` layout map entry)
    splits it is created by Keras's own jitted initializer with that layout
    as its output sharding, so each device makes only its part (Keras does
    this itself only above 250 MiB); and a value from the host assigned to
    it (`model.load_weights` of a `.weights.h5`, `set_weights`,
    `variable.assign` of a numpy array) is copied slice by slice straight
    into its layout (`jax.make_array_from_callback`; the host still holds
    the whole value, as Keras reads each array of a `.weights.h5` whole).
    Device 0 then holds, at most, its shard of the
    weights plus one variable's shard (the old and new values of the
    variable being assigned); without it, Keras makes each such variable
    whole on the default device first. Replicated variables, those without
    a layout, initializers drawing from a `keras.random.SeedGenerator`
    and values already on the devices take Keras's own paths.

    Values are Keras's: assigned values bitwise; created ones bitwise for
    Keras's initializers (Glorot, He, LeCun, truncated normal, uniform,
    orthogonal, zeros, ones) except `RandomNormal`, within an ulp (XLA
    fuses its `mean + stddev * normal` in one program, as it does for
    Keras's own large variables). keras_dp's build (`fit_sharded`,
    `ShardedTrainer.build`) runs inside it already. Nesting is harmless.
    """
    return _compat.sharded_birth()
