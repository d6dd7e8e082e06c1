"""keras_dp: synchronous data-parallel training of Keras 3 models on JAX devices."""

import importlib
import os
import sys

# keras_dp runs on Keras's JAX backend. Choose it for the user when Keras is
# not imported yet and no backend was asked for; refuse any other backend.
# Keras reads KERAS_BACKEND before its config file, so the variable decides
# without importing Keras here: `import keras_dp` (and `keras-dp --help`)
# stays fast, and the public names below load on first use.
if "keras" in sys.modules:
    _backend = sys.modules["keras"].backend.backend()
else:
    _backend = os.environ.setdefault("KERAS_BACKEND", "jax")
if _backend != "jax":
    raise ImportError(
        f"keras_dp needs Keras's JAX backend, but Keras is running on {_backend!r}. "
        "Set KERAS_BACKEND=jax before Keras is first imported (or import "
        "keras_dp first)."
    )

__version__ = "0.1.0"

# Each public name and the module that defines it, imported on first use.
_PUBLIC = {
    "EnsembleResult": "keras_dp.ensemble",
    "LayoutWarning": "keras_dp.keras.layouts",
    "EnsembleTrainer": "keras_dp.ensemble",
    "ShardedTrainer": "keras_dp.trainer",
    "TrainState": "keras_dp.core.state",
    "fit_ensemble": "keras_dp.ensemble",
    "fit_sharded": "keras_dp.api",
    "make_mesh": "keras_dp.mesh",
    "memory_plan": "keras_dp.api",
    "shard_for_processes": "keras_dp.sources.shards",
    "sharded_birth": "keras_dp.keras.layouts",
}
_MODULES = ("datasets", "distributed", "models")

__all__ = sorted([*_PUBLIC, *_MODULES])


def __getattr__(name):
    """Import a public name, or any submodule, when it is first used."""
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
    else:
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
