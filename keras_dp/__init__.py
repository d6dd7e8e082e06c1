"""keras_dp: synchronous data-parallel training of Keras 3 models on JAX devices."""

import os
import sys

# keras_dp runs on Keras's JAX backend. Choose it for the user when Keras is
# not imported yet and no backend was asked for; refuse any other backend.
if "keras" not in sys.modules:
    os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402

if keras.backend.backend() != "jax":
    raise ImportError(
        "keras_dp needs Keras's JAX backend, but Keras is running on "
        f"{keras.backend.backend()!r}. Set KERAS_BACKEND=jax before Keras is "
        "first imported (or import keras_dp first)."
    )

from keras_dp import datasets  # noqa: E402
from keras_dp import distributed  # noqa: E402
from keras_dp import models  # noqa: E402
from keras_dp.ensemble import EnsembleResult  # noqa: E402
from keras_dp.ensemble import EnsembleTrainer  # noqa: E402
from keras_dp.ensemble import fit_ensemble  # noqa: E402
from keras_dp.fit import fit_sharded  # noqa: E402
from keras_dp.memory import memory_plan  # noqa: E402
from keras_dp.mesh import make_mesh  # noqa: E402
from keras_dp.state import TrainState  # noqa: E402
from keras_dp.trainer import ShardedTrainer  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "EnsembleResult",
    "EnsembleTrainer",
    "ShardedTrainer",
    "TrainState",
    "datasets",
    "distributed",
    "fit_ensemble",
    "fit_sharded",
    "make_mesh",
    "memory_plan",
    "models",
]
