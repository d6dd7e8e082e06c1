"""What the ensemble's one compiled step takes from member 0: its layers, loss, metrics and optimizer.

The step is traced once, from member 0 (`keras_dp.ensemble.steps`), and
`vmap`ped over the members' stacked variables. So everything that is not a
variable is member 0's for every member: a layer's activation or dropout
rate, the loss, the metrics, the optimizer's type and settings (momentum,
`beta_1`, a learning-rate schedule). A member that differs there would train
silently as member 0. What lives in variables may differ: the initial
values, and the learning rate when it is a float (the optimizer keeps it in a
variable, so member `i` trains with its own).
"""

import numbers
import warnings

import keras

from keras_dp import _compat


def check_same_recipe(models):
    """Refuse members whose layers, loss, metrics or optimizer differ from member 0's.

    Initial values (initializers, seeds) and a float learning rate may
    differ; layer and optimizer names are ignored.

    Raises:
        ValueError: member `i` differs from member 0 in a layer's settings,
            its compile settings (loss, metrics, ...) or its optimizer's.
    """
    first = _recipe(models[0])
    for index, model in enumerate(models[1:], start=1):
        difference = _first_difference(first, _recipe(model))
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
    settings = {"class": type(optimizer).__qualname__, **_config(optimizer)}
    settings.pop("name", None)
    if isinstance(settings.get("learning_rate"), numbers.Number):
        del settings["learning_rate"]  # a variable of the optimizer's: each member's own
    parts.append(("the optimizer", settings))
    return parts


def _layer_settings(layer):
    settings = {"class": type(layer).__qualname__, **_config(layer)}
    # Names differ between calls (dense, dense_1); initializers and seeds
    # only set the initial values, which are each member's own. A wrapped
    # layer (Bidirectional's, TimeDistributed's) is a layer of its own in
    # the list, compared there, its name left out.
    return {key: value for key, value in settings.items()
            if key not in ("name", "seed") and not key.endswith("_initializer")
            and not _holds_layers(value)}


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
    settings.pop("optimizer", None)  # compared on its own, without its name
    return settings


def _config(obj):
    try:
        return dict(obj.get_config())
    except Exception:  # noqa: BLE001 - no config (a subclassed layer): nothing to compare
        return {}


def _first_difference(first, other):
    """A phrase naming the first part of `other` that differs from `first`, or None."""
    if [ours["class"] for _, ours in first[:-2]] != [theirs["class"] for _, theirs in other[:-2]]:
        return (f"its layers: {[theirs['class'] for _, theirs in other[:-2]]} where member 0 "
                f"has {[ours['class'] for _, ours in first[:-2]]}")
    for (what, ours), (_, theirs) in zip(first, other):
        keys = [key for key in sorted(set(ours) | set(theirs))
                if not _same(ours.get(key), theirs.get(key))]
        if keys:
            key = keys[0]
            return (f"{what}: {key}={_short(theirs.get(key))} where member 0 has "
                    f"{key}={_short(ours.get(key))}")
    return None


def _short(value, limit=200):
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _same(a, b):
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - arrays in a config: compare their text
        return repr(a) == repr(b)
