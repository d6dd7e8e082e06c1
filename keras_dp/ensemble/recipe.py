"""What the ensemble's one compiled step takes from member 0: its layers, loss, metrics and optimizer.

The step is traced once, from member 0 (`keras_dp.ensemble.steps`), and
`vmap`ped over the members' stacked variables. So everything that is not a
variable is member 0's for every member: a layer's activation or dropout
rate, the loss, the metrics, the optimizer's type and settings (momentum,
`beta_1`, a learning-rate schedule). A member that differs there would train
silently as member 0. What lives in variables may differ: the initial
values, and the learning rate when it is a float (the optimizer keeps it in a
variable, so member `i` trains with its own); but not what a preprocessing
layer was adapted to, which it keeps in variables and reads, in `call`, as
constants made from them.
"""

import numbers
import warnings

import keras
import numpy as np

from keras_dp import _compat


def check_same_recipe(models):
    """Refuse members whose layers, loss, metrics or optimizer differ from member 0's.

    Compared: each layer's config, the compile config and the optimizer's
    config, as Keras serialises them, and the values a preprocessing layer
    was adapted to (constants of the traced step, not each member's own).
    Initial values (initializers, seeds), a float learning rate (an
    optimizer variable, also inside a `LossScaleOptimizer`), and the names
    Keras numbers (`dense_1`, `auc_1`, `adam_1`) may differ. What no config
    shows (a subclassed layer without `get_config`, a loss function's
    closure, a subclassed model's own attributes) is not compared.

    Raises:
        ValueError: member `i` differs from member 0 in a layer's settings
            or adapted values, its compile settings (loss, metrics, ...) or
            its optimizer's.
    """
    first = _recipe(models[0])
    for index, model in enumerate(models[1:], start=1):
        difference = _first_difference(first, _recipe(model))
        if difference is None:
            difference = _adapted_difference(models[0], model)
        if difference is not None:
            raise ValueError(
                f"Member {index} differs from member 0 in {difference}. The ensemble "
                "runs one compiled step, traced from member 0, for every member, so "
                f"member {index} would train with member 0's settings. build_model must "
                "return the same layers, loss, metrics and optimizer settings on every "
                "call; only initial values and a float learning rate may differ. Train "
                "members that differ with separate fits (keras_dp.fit_sharded, or "
                "model.fit)."
            )


def _recipe(model):
    """`[(what, settings)]`: each layer's config, the compile config and the optimizer's.

    Models nested in `model` are left out (their configs hold their layers'
    names); their layers are in the list.
    """
    parts = [(f"layer {layer.name!r} ({type(layer).__name__})", _layer_settings(layer))
             for layer in _compat.all_layers(model) if not isinstance(layer, keras.Model)]
    parts.append(("the compile settings", _compile_settings(model)))
    optimizer = model.optimizer
    settings = _without_identity({"class": type(optimizer).__qualname__, **_config(optimizer)},
                                 float_learning_rate=True)
    parts.append(("the optimizer", settings))
    return parts


def _layer_settings(layer):
    settings = {"class": type(layer).__qualname__, **_config(layer)}
    # Initializers and seeds only set the initial values, which are each
    # member's own. A wrapped layer (Bidirectional's, TimeDistributed's) is
    # a layer of its own in the list, compared there.
    settings = {key: value for key, value in settings.items()
                if key != "seed" and not key.endswith("_initializer")
                and not _holds_layers(value)}
    return _without_identity(settings)


def _without_identity(value, float_learning_rate=False):
    """A serialised config without the names Keras numbers per object (at any depth).

    `name` goes everywhere but in a dtype policy, where it is the policy
    ("mixed_float16"). With `float_learning_rate`, a `learning_rate` that is
    a number goes too: it is an optimizer variable, each member's own.
    """
    if isinstance(value, dict):
        kept = {}
        for key, item in value.items():
            if key == "name" and not _is_policy(value):
                continue
            if float_learning_rate and key == "learning_rate" and isinstance(
                    item, numbers.Number):
                continue
            kept[key] = item if key == "dtype" else _without_identity(item, float_learning_rate)
        return kept
    if isinstance(value, (list, tuple)):
        return type(value)(_without_identity(item, float_learning_rate) for item in value)
    return value


def _is_policy(config):
    return "Policy" in str(config.get("class_name", ""))


def _holds_layers(value):
    """Whether `value` is a serialised layer (a config with `trainable`), or a list of them."""
    if isinstance(value, (list, tuple)):
        return bool(value) and all(map(_holds_layers, value))
    return isinstance(value, dict) and "trainable" in (value.get("config") or {})


def _compile_settings(model):
    try:
        with warnings.catch_warnings():  # Keras warns on serialising a lambda loss
            warnings.simplefilter("ignore")
            settings = dict(model.get_compile_config() or {})
    except Exception:  # noqa: BLE001 - a loss Keras cannot serialise: nothing to compare
        return {}
    settings.pop("optimizer", None)  # compared on its own
    # How Keras runs the step, not what it computes: keras_dp traces it once.
    for key in ("jit_compile", "run_eagerly", "steps_per_execution", "auto_scale_loss"):
        settings.pop(key, None)
    return _without_identity(settings)


def _config(obj):
    try:
        return dict(obj.get_config())
    except Exception:  # noqa: BLE001 - no config (a subclassed layer): nothing to compare
        return {}


def _adapted_difference(first, other):
    """A phrase naming a preprocessing layer adapted to other values than member 0's, or None.

    A layer with `adapt` (Normalization, Discretization) keeps what it was
    adapted to in variables, but `call` reads constants made from them
    (`finalize_state`), so the step traced from member 0 holds member 0's.
    """
    for ours, theirs in zip(_compat.all_layers(first), _compat.all_layers(other)):
        if not hasattr(ours, "adapt") or isinstance(ours, keras.Model):
            continue
        for a, b in zip(ours.variables, theirs.variables):
            if not np.array_equal(np.asarray(a.value), np.asarray(b.value), equal_nan=True):
                return (f"layer {theirs.name!r} ({type(theirs).__name__}): it was adapted to "
                        f"other values ({b.path}) than member 0's. Adapt the layer once, "
                        "outside build_model, and use that one layer in every member, or "
                        "adapt every member's on the same data")
    return None


def _first_difference(first, other):
    """A phrase naming the first part of `other` that differs from `first`, or None."""
    if [ours["class"] for _, ours in first[:-2]] != [theirs["class"] for _, theirs in other[:-2]]:
        return (f"its layers: {[theirs['class'] for _, theirs in other[:-2]]} where member 0 "
                f"has {[ours['class'] for _, ours in first[:-2]]}")
    for (what, ours), (_, theirs) in zip(first, other):
        found = _leaf_difference(ours, theirs, "")
        if found is not None:
            path, our_value, their_value = found
            return (f"{what}: {path}={_short(their_value)} where member 0 has "
                    f"{path}={_short(our_value)}")
    return None


def _leaf_difference(ours, theirs, path):
    """`(path, ours, theirs)` at the first place two configs differ, or None.

    Dicts and lists holding dicts or lists are walked into; other lists,
    arrays and scalars are compared whole (`_same`).
    """
    if isinstance(ours, dict) and isinstance(theirs, dict):
        for key in sorted(set(ours) | set(theirs), key=str):
            found = _leaf_difference(ours.get(key), theirs.get(key),
                                     f"{path}.{key}" if path else str(key))
            if found is not None:
                return found
        return None
    if (isinstance(ours, (list, tuple)) and isinstance(theirs, (list, tuple))
            and len(ours) == len(theirs)
            and any(isinstance(item, (dict, list, tuple)) for item in (*ours, *theirs))):
        for index, (a, b) in enumerate(zip(ours, theirs)):
            found = _leaf_difference(a, b, f"{path}[{index}]")
            if found is not None:
                return found
        return None
    return None if _same(ours, theirs) else (path, ours, theirs)


def _short(value, limit=200):
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _same(a, b):
    """Equal values; arrays element by element, and NaN equal to NaN."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        return (a.shape == b.shape and a.dtype == b.dtype
                and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True  # NaN (Masking's mask_value, say)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an object without a clear equality
        return repr(a) == repr(b)
