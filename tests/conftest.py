"""Test setup: 8 simulated CPU devices, the shared MNIST, a slow marker, one fresh JAX compilation cache.

XLA reads the device count when JAX first starts a backend, so the flag is set
here, before anything imports JAX.
"""

import os
import pathlib

# The suite's programs are small and each is compiled once, so LLVM's
# optimisation of them costs more than it saves: off, the suite runs about a
# quarter faster. What a test compares (keras_dp against Keras, one run
# against another) is compiled alike on both sides. KERAS_DP_TEST_OPTIMIZE=1
# keeps XLA's default optimisation (docs/testing.md).
_FAST_COMPILE = ([] if os.environ.get("KERAS_DP_TEST_OPTIMIZE") == "1" else
                 ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"])
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8", *_FAST_COMPILE]
).strip()
os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# No persistent compilation cache in the user's home: tests that check the
# cache give it a directory of their own (tests/test_compilation_cache.py).
os.environ["KERAS_DP_COMPILATION_CACHE"] = "0"
# One JAX persistent compilation cache for the whole run, fresh each run and
# removed at its end: a program several tests compile alike (the convnet's
# step on the same devices, in this process and in the subprocesses that
# inherit the variable) compiles once. Tests that check the cache set their own.
# It holds every program, however fast it compiled (JAX's default keeps only
# those that took 1 s): most tests compile small models alike, and loading
# them cut the in-process run by 10 to 15% on the 2-core VM. (JAX reports a
# program loaded from the cache as compiled, as tests/test_programs.py counts.)
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="keras_dp_tests_jax_cache_")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
# The processes the tests start (workers in tests/scripts, `keras-dp launch`)
# import this checkout's keras_dp: a worker script's own directory, not the
# working directory, heads its sys.path, so it imported the installed one
# instead (an editable install of another worktree: its multi-process tests
# ran that tree's code).
ROOT = pathlib.Path(__file__).resolve().parents[1]
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(ROOT)] + [path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path])
_SHARED_DATA = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data"
if "KERAS_DP_DATA_DIR" not in os.environ and (_SHARED_DATA / "mnist.npz").is_file():
    os.environ["KERAS_DP_DATA_DIR"] = str(_SHARED_DATA)

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import keras_dp  # noqa: E402


def pytest_addoption(parser):
    parser.addoption(
        "--runslow", action="store_true", help="also run tests marked slow"
    )


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def mnist():
    """A small slice of real MNIST: 2,048 training and 1,024 test images."""
    (x, y), (x_test, y_test) = keras_dp.datasets.load_mnist()
    return (x[:2048, ..., None], y[:2048]), (x_test[:1024, ..., None], y_test[:1024])


# The guide's convnet gives this conv a bias and then a BatchNormalization
# that subtracts the batch mean, bias included: its true gradient is 0, its
# values are rounding noise (amplified to +-lr steps by Adam), and it has no
# effect on any output. It is the one variable not compared.
NO_GRADIENT = "large_k/bias"


def convnet(seed=0, learning_rate=1e-3):
    """The guide's convnet, compiled, with initial weights fixed by `seed`."""
    keras.utils.set_random_seed(seed)
    return keras_dp.models.compile_classifier(
        keras_dp.models.convnet(), learning_rate=learning_rate
    )


def mlp(seed=0, dropout=0.0):
    """A small compiled MLP on flattened 28x28 images: fast to compile."""
    keras.utils.set_random_seed(seed)
    return unseeded_mlp(dropout)


def unseeded_mlp(dropout=0.0):
    """`mlp` without seeding, for callers that seed (the ensemble seeds each member)."""
    model = keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Rescaling(1 / 255),
            keras.layers.Flatten(),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dropout(dropout),
            keras.layers.Dense(10),
        ]
    )
    return keras_dp.models.compile_classifier(model)


def sgd_mlp(seed=0, dropout=0.0, momentum=0.0):
    """`mlp` under SGD: plain SGD follows Keras's fit to float rounding, where
    Adam turns rounding noise in near-zero gradients into full-size steps."""
    model = mlp(seed, dropout)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=momentum), loss=model.loss,
                  metrics=["accuracy"])
    return model


class InferenceNoise(keras.layers.Layer):
    """Scales its input by uniform noise in every mode (Monte Carlo sampling at predict)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(7)

    def call(self, x):
        return x * keras.random.uniform(keras.ops.shape(x), seed=self.seed_generator)


class SubclassedClassifier(keras.Model):
    """A subclassed MLP on 28x28 images, unbuilt until its first call."""

    def __init__(self, dropout=0.0):
        super().__init__()
        self.flatten = keras.layers.Flatten()
        self.hidden = keras.layers.Dense(32, activation="relu")
        self.dropout = keras.layers.Dropout(dropout)
        self.out = keras.layers.Dense(10)

    def call(self, images, training=False):
        hidden = self.hidden(self.flatten(keras.ops.cast(images, "float32") / 255))
        return self.out(self.dropout(hidden, training=training))


class BatchEnds(keras.callbacks.Callback):
    """Records the batch index of every `on_train_batch_end` in `ends`."""

    def __init__(self):
        super().__init__()
        self.ends = []

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(batch)


class StopAtBatch(keras.callbacks.Callback):
    """Sets `model.<flag>` at the end of batch `at`, as Keras's evaluate and predict honour it."""

    def __init__(self, flag, at=1):
        super().__init__()
        self.flag, self.at = flag, at

    def _stop(self, batch):
        if batch == self.at:
            setattr(self.model, self.flag, True)

    def on_test_batch_end(self, batch, logs=None):
        self._stop(batch)

    def on_predict_batch_end(self, batch, logs=None):
        self._stop(batch)


def batches_of(mnist, count, size=64):
    (x, y), _ = mnist
    return [(x[i * size:(i + 1) * size], y[i * size:(i + 1) * size]) for i in range(count)]


def weights(model):
    return [np.asarray(w) for w in model.get_weights()]


# float32 from two different programs (Keras's fit and keras_dp's step, 1
# and N devices, K steps per call and 1) sums in different orders, and the
# order depends on the CPU too (vector width, kernels, threads). Rounding is
# relative to a variable's size, not to each entry: an entry near zero has no
# relative precision of its own, so an element-wise rtol with a fixed atol
# fails on some CPUs (an AMD EPYC was 2.5e-6 off in a kernel of largest entry
# 0.07). The tolerance is `scale` times the expected array's largest |entry|.
def assert_close_to_scale(actual, expected, scale=1e-5, err_msg=""):
    """Every entry of `actual` within `scale` times `expected`'s largest |entry|."""
    expected = np.asarray(expected)
    largest = float(np.max(np.abs(expected))) if expected.size else 0.0
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=0,
                               atol=scale * max(largest, 1e-6), err_msg=err_msg)


def assert_weights_close(a, b, scale=1e-5):
    """`a`'s weights equal `b`'s, each within `scale` of the variable's largest |entry|."""
    for left, right, variable in zip(weights(a), weights(b), b.weights, strict=True):
        assert_close_to_scale(left, right, scale, err_msg=variable.path)


def assert_weights_equal(a, b):
    for left, right in zip(weights(a), weights(b), strict=True):
        np.testing.assert_array_equal(left, right)


def devices(n):
    return jax.devices()[:n]


def sigterm_stops(text):
    """Where each "SIGTERM received; saved a checkpoint" line of `text` says the run stopped.

    A list of `(epoch, steps)`, 0-based, `steps` steps of epoch `epoch`
    done: "at the end of epoch 2" is `(2, 0)`, "after 5 steps of epoch 3"
    is `(2, 5)`.
    """
    import re

    stops = []
    for line in re.findall(r"SIGTERM received; saved a checkpoint in .*", text):
        end = re.search(r" at the end of epoch (\d+)\.", line)
        after = re.search(r" after (\d+) steps of epoch (\d+)\.", line)
        stops.append((int(end[1]), 0) if end else (int(after[2]) - 1, int(after[1])))
    return stops
