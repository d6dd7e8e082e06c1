"""The peak bytes on device 0 while a model split over a 2x2 mesh is built and loaded.

    python tests/scripts/sharded_birth.py --model gemma|dense [--keras-only]

`Device0` (also imported by tests/test_sharded_birth.py) wraps, while it
watches, the points where a Keras variable gets a value: the value
converted (`JaxVariable._convert_to_tensor`, where `assign` turns a numpy
array from the host into a `jax.Array`), laid out
(`JaxVariable._direct_assign`, before and after: the value given and the
value kept are both alive there), and created from its initializer
(`JaxVariable._initialize_with_initializer`). At each it sums, over
`jax.live_arrays()`, the bytes each array keeps on device 0 (one shard's
bytes for a split array, the whole array for one that is whole there), and
keeps the largest sum. Nothing of this is in the library: it measures it.

Each phase prints one JSON line: `peak` and `after` are device 0's bytes
above what it held before the phase (`before`), `largest` the largest
variable's whole bytes. The phases, on 4 simulated CPU devices, a
("batch", "model") 2x2 mesh:

- `gemma`: a keras_hub `GemmaCausalLM` from a config under
  `distribution.scope()` with `GemmaBackbone.get_layout_map`
  (`create`: Keras creates its weights), keras_dp's build of its
  optimizer and metrics from a batch (`build`), the state placed
  (`place`), one fit's write-back (`fit`), `model.load_weights` of a
  `.weights.h5` onto a second model (`load_weights`), `set_weights` of
  numpy arrays (`set_weights`), and a keras_dp checkpoint restored
  (`restore`).
- `dense`: a plain `Sequential` of Dense layers that keras_dp builds from
  the first batch under a `ModelParallel` (`build`: its layers, optimizer
  and metrics), then the same phases.

`--keras-only` runs keras_dp's build with its birth hook off
(`keras_dp._compat.sharded_birth` made a no-op): what Keras does alone.
`--user-hook` creates, loads and sets the weights inside
`keras_dp.sharded_birth()` too: what it gives those calls.
"""

import contextlib
import gc
import json
import os
import sys
import tempfile
import time

import jax
import numpy as np


def device0_bytes(device):
    """Bytes `jax.live_arrays()` keep on `device`: a shard's for a split array, all of a whole one."""
    total = 0
    for array in jax.live_arrays():
        if array.is_deleted() or device not in array.sharding.device_set:
            continue
        shape = array.sharding.shard_shape(array.shape)
        total += int(np.prod(shape, dtype=np.int64)) * array.dtype.itemsize
    return total


class Device0:
    """The most bytes device 0 held at any variable's creation or assignment, while `watching`."""

    def __init__(self, device=None):
        self.device = device or jax.devices()[0]
        self.peak = 0
        self.samples = 0

    def sample(self):
        self.samples += 1
        self.peak = max(self.peak, device0_bytes(self.device))

    @contextlib.contextmanager
    def watching(self):
        """Sample at each creation and assignment of a Keras variable; yield this tracker."""
        from keras.src.backend.jax import core

        cls = core.JaxVariable
        originals = {name: getattr(cls, name) for name in
                     ("_convert_to_tensor", "_direct_assign", "_initialize_with_initializer")}

        def convert(variable, value, dtype=None):
            converted = originals["_convert_to_tensor"](variable, value, dtype=dtype)
            self.sample()  # the converted value alive (whole, for an array from the host)
            return converted

        def direct_assign(variable, value):
            self.sample()
            originals["_direct_assign"](variable, value)
            self.sample()  # the value given and the one kept, both alive

        def initialize(variable, initializer):
            originals["_initialize_with_initializer"](variable, initializer)
            self.sample()

        device_put = jax.device_put

        def put(*args, **kwargs):  # keras_dp's own placement and write-back
            self.sample()
            placed = device_put(*args, **kwargs)
            self.sample()
            return placed

        cls._convert_to_tensor, cls._direct_assign = convert, direct_assign
        cls._initialize_with_initializer = initialize
        jax.device_put = put
        gc.collect()
        self.peak, self.samples = 0, 0
        self.before = device0_bytes(self.device)
        started = time.perf_counter()
        self.sample()
        try:
            yield self
        finally:
            self.seconds = time.perf_counter() - started
            for name, original in originals.items():
                setattr(cls, name, original)
            jax.device_put = device_put
            gc.collect()
            self.sample()
            self.after = device0_bytes(self.device)

    def report(self, phase, variables=()):
        """One phase's numbers: bytes above `before`, and the largest variable's whole bytes."""
        sizes = [int(np.prod(v.shape, dtype=np.int64)) * np.dtype(v.dtype).itemsize
                 for v in variables]
        return {"phase": phase, "before": self.before, "peak": self.peak - self.before,
                "after": self.after - self.before, "largest": max(sizes, default=0),
                "samples": self.samples, "seconds": round(self.seconds, 3)}


# -- The measurement, as a script ----------------------------------------------


def gemma_model(distribution):
    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    with distribution.scope():
        backbone = keras_hub.models.GemmaBackbone(
            vocabulary_size=1024, num_layers=2, num_query_heads=4, num_key_value_heads=2,
            hidden_dim=128, intermediate_dim=256, head_dim=32)
        model = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def gemma_distribution():
    import keras
    import keras_hub

    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], jax.devices()[:4])
    return keras.distribution.ModelParallel(
        layout_map=keras_hub.models.GemmaBackbone.get_layout_map(mesh), batch_dim_name="batch")


def gemma_data(rows=8, length=16):
    tokens = np.random.default_rng(0).integers(1, 1024, size=(rows, length + 1)).astype("int32")
    return {"token_ids": tokens[:, :-1], "padding_mask": np.ones((rows, length), bool)}, \
        tokens[:, 1:]


def dense_model(distribution=None):
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Dense(1024, activation="relu", name="up"),
                              keras.layers.Dense(256, activation="relu", name="mid"),
                              keras.layers.Dense(16, name="down")])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    return model


def dense_distribution():
    import keras

    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], jax.devices()[:4])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*up/kernel"] = ("batch", "model")
    layout_map[".*mid/kernel"] = ("model", None)
    layout_map[".*down/kernel"] = ("model", None)
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def dense_data(rows=8):
    rng = np.random.default_rng(0)
    return rng.normal(size=(rows, 512)).astype("float32"), \
        rng.normal(size=(rows, 16)).astype("float32")


def phases(kind, keras_only=False, user_hook=False):
    """Yield each phase's report (see the module doc)."""
    import keras

    import keras_dp
    from keras_dp import _compat
    from keras_dp.checkpoint import store
    from keras_dp.core.live import Position

    user = keras_dp.sharded_birth if user_hook else contextlib.nullcontext
    if keras_only:
        _compat.sharded_birth = contextlib.nullcontext
    make, distribution = ((gemma_model, gemma_distribution()) if kind == "gemma"
                          else (dense_model, dense_distribution()))
    x, y = gemma_data() if kind == "gemma" else dense_data()
    tracker = Device0()
    if kind == "gemma":
        with tracker.watching(), user():
            model = make(distribution)
        yield tracker.report("create", model.weights)
    else:
        model = make(distribution)
    trainer = keras_dp.ShardedTrainer(model, distribution=distribution)
    with tracker.watching():
        trainer.build((x, y))
    variables = [v for group in keras_dp.TrainState.variables_of(model) for v in group]
    yield tracker.report("build", variables)
    with tracker.watching():
        state = trainer.init_state()
    yield tracker.report("place", variables)
    del state
    with tracker.watching():
        keras_dp.fit_sharded(model, x, y, batch_size=4, epochs=1, verbose=0,
                             distribution=distribution)
    yield tracker.report("fit", variables)
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "model.weights.h5")
        model.save_weights(path)
        values = [np.array(v) for v in model.get_weights()]
        state = trainer.init_state()
        checkpoints = store.Checkpoints(os.path.join(directory, "checkpoints"), lock=False)
        checkpoints.save(state, Position(1, 0), trainer.seed)
        del state, model, trainer, variables
        second = make(distribution)
        second_trainer = keras_dp.ShardedTrainer(second, distribution=distribution)
        second_trainer.build((x, y))
        with tracker.watching(), user():
            second.load_weights(path)
        yield tracker.report("load_weights", second.weights)
        with tracker.watching(), user():
            second.set_weights(values)
        yield tracker.report("set_weights", second.weights)
        with tracker.watching():
            checkpoints.restore(second, second_trainer.seed)
        variables = [v for group in keras_dp.TrainState.variables_of(second) for v in group]
        yield tracker.report("restore", variables)
        checkpoints.close()
    yield {"phase": "shard", "bytes": sum(
        int(np.prod(v.value.sharding.shard_shape(v.shape))) * np.dtype(v.dtype).itemsize
        for v in variables if jax.devices()[0] in v.value.sharding.device_set),
        "keras": keras.__version__}


def main():
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["gemma", "dense"], default="dense")
    parser.add_argument("--keras-only", action="store_true")
    parser.add_argument("--user-hook", action="store_true")
    args = parser.parse_args()
    for report in phases(args.model, args.keras_only, args.user_hook):
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""),
                                        "--xla_force_host_platform_device_count=4"])
    os.environ.setdefault("KERAS_BACKEND", "jax")
    sys.exit(main())
