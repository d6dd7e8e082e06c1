"""Which keras_dp modules one batch of arrays passes through, from `fit_sharded` to the compiled step and back.

Runs a 2-epoch fit of a small model on arrays over 2 simulated CPU devices and
records, with a profile hook on every thread, each keras_dp function called
 - beneath the epoch's batch loop (`train_batches`) in the second epoch (steady
   state), with every keras_dp frame on its stack (so the entry chain from
   `fit_sharded` counts too), the logs' way back included;
 - on keras_dp's look-ahead thread during that epoch (it reads and places batches);
 - while a train step is traced (the code inside the compiled step).
It prints how many modules that is, and which, in the order first met.
tests/test_architecture.py holds the count to at most 10.

    python scripts/batch_route.py [--host]    # --host: data_on_device=False
"""

import os
import sys
import threading

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dp  # noqa: E402

try:  # whether JAX is tracing: where the compiled step's own code runs
    from jax.core import trace_state_clean  # noqa: E402
except ImportError:  # pragma: no cover - an older or newer JAX
    from jax._src.core import trace_state_clean  # noqa: E402


def module_of(frame):
    return frame.f_globals.get("__name__") or ""


def keras_dp_stack(frame):
    """The keras_dp `(module, function)` frames of `frame`'s stack, outermost first."""
    stack = []
    while frame is not None:
        if module_of(frame).startswith("keras_dp"):
            stack.append((module_of(frame), frame.f_code.co_name))
        frame = frame.f_back
    return stack[::-1]


class Route:
    """The profile hook: the modules on the route, in the order first met."""

    def __init__(self):
        self.epoch = None
        self.modules = []

    def __call__(self, frame, event, arg):
        if event != "call" or not module_of(frame).startswith("keras_dp"):
            return
        stack = keras_dp_stack(frame)
        functions = {function for _, function in stack}
        looking_ahead = threading.current_thread().name.startswith("keras_dp-prefetch")
        in_epoch = self.epoch == 1 and ("train_batches" in functions or looking_ahead)
        in_step = "train_step" in functions and not trace_state_clean()
        if in_epoch or in_step:
            for module, _ in stack:
                if module not in self.modules:
                    self.modules.append(module)


class Epochs(keras.callbacks.Callback):
    """Tells the route which epoch runs."""

    def __init__(self, route):
        super().__init__()
        self.route = route

    def on_epoch_begin(self, epoch, logs=None):
        self.route.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        self.route.epoch = None


def main():
    host = "--host" in sys.argv
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(3)])
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 8)).astype("float32"), rng.integers(0, 3, 64)
    route = Route()
    threading.setprofile(route)
    sys.setprofile(route)
    try:
        keras_dp.fit_sharded(model, x, y, batch_size=16, epochs=2, verbose=0,
                             callbacks=[Epochs(route)], data_on_device=not host and "auto")
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    names = [module.replace("keras_dp.", "") for module in route.modules]
    where = "host-fed" if host else "data on the devices"
    print(f"{len(names)} modules ({where}): {', '.join(names)}")


if __name__ == "__main__":
    main()
