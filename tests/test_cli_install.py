"""The core install: keras_dp and `keras-dp train` without TensorFlow or matplotlib.

Both are extras (`keras_dp[tf]` for tf.data, `keras_dp[plot]` for the
training curves). The check runs in a fresh interpreter in which Python's
path finder cannot see `tensorflow` or `matplotlib`, so importing them fails
and `importlib.util.find_spec` reports them absent, as when they are not
installed.
"""

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from keras_dp import datasets

HIDE = '''
import importlib.machinery
import sys


class Hidden:
    """Python's path finder, blind to some top-level packages."""

    def __init__(self, names):
        self.names = names

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.names:
            return None
        return importlib.machinery.PathFinder.find_spec(name, path, target)

    def invalidate_caches(self):
        importlib.machinery.PathFinder.invalidate_caches()


sys.meta_path[:] = [Hidden({"tensorflow", "matplotlib"})
                    if finder is importlib.machinery.PathFinder else finder
                    for finder in sys.meta_path]
'''

CHECKS = '''
import contextlib, importlib.util, io, json
import numpy as np
import pytest

report = {"found": [name for name in ("tensorflow", "matplotlib")
                    if importlib.util.find_spec(name) is not None]}
from keras_dp import cli
out = io.StringIO()
with contextlib.redirect_stdout(out):
    cli.main(["train", "--epochs", "1", "--verbose", "0",
              "--data-dir", DATA, "--output-dir", OUTPUT])
report["cli"] = out.getvalue()

import keras
import keras_dp

model = keras.saving.load_model(OUTPUT + "/convnet.keras")
x = np.random.default_rng(0).integers(0, 255, (64, 28, 28, 1)).astype("uint8")
y = np.arange(64) % 10


class Batches(keras.utils.PyDataset):
    def __len__(self):
        return 2

    def __getitem__(self, index):
        return x[32 * index:32 * (index + 1)], y[32 * index:32 * (index + 1)]


report["pydataset"] = keras_dp.fit_sharded(model, Batches(), verbose=0).history["loss"]
report["iterable"] = keras_dp.fit_sharded(
    model, ((x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16)), verbose=0).history["loss"]
report["download"] = str(keras_dp.datasets._download("file://" + SOURCE, SHA256))
try:
    keras_dp.sources.tfdata.hide_gpus_from_tensorflow()
except ImportError as error:
    report["tf_message"] = str(error)
report["imported"] = [name for name in ("tensorflow", "matplotlib") if name in sys.modules]
print(json.dumps(report))
'''


@pytest.mark.slow  # 13 s: moved out of CI to keep the default run under 10 minutes
def test_train_and_read_arrays_pydatasets_and_iterables_without_tf_or_matplotlib(tmp_path):
    (x, y), (x_test, y_test) = datasets.load_mnist(datasets.BUNDLED_MNIST)
    source = tmp_path / "mnist_small.npz"
    np.savez(source, x_train=x[:256], y_train=y[:256], x_test=x_test[:128], y_test=y_test[:128])
    sha256 = hashlib.sha256(source.read_bytes()).hexdigest()
    constants = (f"DATA = {str(source)!r}\nOUTPUT = {str(tmp_path / 'out')!r}\n"
                 f"SOURCE = {str(source)!r}\nSHA256 = {sha256!r}\n")
    env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
    env["KERAS_HOME"] = str(tmp_path / "keras_home")
    result = subprocess.run([sys.executable, "-c", HIDE + constants + CHECKS],
                            capture_output=True, text=True, timeout=280, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["found"] == [] and report["imported"] == []
    assert "No GPU or TPU: training on 2 simulated CPU devices" in report["cli"]
    assert "256 training images; the 128 test images are the validation data" in report["cli"]
    assert ("No training curves: they need matplotlib (pip install 'keras_dp[plot]')"
            in report["cli"])
    assert sorted(os.listdir(tmp_path / "out")) == ["convnet.keras"]
    assert len(report["pydataset"]) == 1 and np.isfinite(report["pydataset"][0])
    assert len(report["iterable"]) == 1 and np.isfinite(report["iterable"][0])
    # Keras's download goes through without TensorFlow, into Keras's cache.
    downloaded = tmp_path / "keras_home" / "datasets" / "mnist.npz"
    assert report["download"] == str(downloaded)
    assert downloaded.read_bytes() == source.read_bytes()
    assert report["tf_message"] == ("tf.data input needs TensorFlow, which keras_dp installs "
                                    "only with its `tf` extra: pip install 'keras_dp[tf]'.")
