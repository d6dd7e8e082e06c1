"""Datasets: MNIST from a path, a data directory, Keras's cache, or the bundle.

`load_mnist` looks, in order, at an explicit path, at
`$KERAS_DP_DATA_DIR/mnist.npz`, at Keras's cache (`~/.keras/datasets`), then
downloads with `keras.utils.get_file`. When all of these fail (no network, no
data directory) it falls back to the small real subset bundled in the
package (5,000 training and 1,000 test images) and says so in one line on
stderr (the `keras_dp.datasets` logger).
"""

import logging
import os
import pathlib

import numpy as np

BUNDLED_MNIST = pathlib.Path(__file__).resolve().parent / "data" / "mnist_subset.npz"
FILENAME = "mnist.npz"
MNIST_ORIGIN = "https://storage.googleapis.com/tensorflow/tf-keras-datasets/mnist.npz"
MNIST_SHA256 = "731c5ac602752760c8e48fbffcf8c3b850d9dc2a2aedcf2cc48468fc17b673d1"
BUNDLED_SOURCE = (
    "the 5,000-image MNIST subset bundled with keras_dp (full MNIST was not "
    "found: no path, no $KERAS_DP_DATA_DIR, none in Keras's cache, and the "
    "download failed)"
)

_log = logging.getLogger(__name__)


def load_mnist(path=None):
    """Return MNIST as `(x_train, y_train), (x_test, y_test)` numpy arrays.

    Images are `uint8` of shape `(n, 28, 28)`, labels `uint8` of shape
    `(n,)`, exactly as `keras.datasets.mnist.load_data()` returns them.

    Args:
        path: an `mnist.npz` file, or a directory holding one.

    Raises:
        FileNotFoundError: `path` was given but holds no `mnist.npz`.
    """
    file, source = find_mnist(path)
    if file == BUNDLED_MNIST and path is None:
        _log.warning(
            "Using %s. Set KERAS_DP_DATA_DIR to a directory with mnist.npz "
            "for the full 60,000 training images.", source,
        )
    with np.load(file, allow_pickle=False) as data:
        return (data["x_train"], data["y_train"]), (data["x_test"], data["y_test"])


def find_mnist(path=None):
    """Return `(file, description)` for the MNIST copy `load_mnist` would read.

    Prints nothing: the description says where the file came from, and for
    the bundled subset why (`BUNDLED_SOURCE`).
    """
    if path is not None:
        file = _in_dir(pathlib.Path(path))
        if not file.is_file():
            raise FileNotFoundError(
                f"No MNIST file at {file}. Pass the path of an mnist.npz in "
                "Keras's layout, or a directory that holds one."
            )
        return file, f"MNIST from {file}"
    data_dir = os.environ.get("KERAS_DP_DATA_DIR")
    if data_dir and _in_dir(pathlib.Path(data_dir)).is_file():
        return _in_dir(pathlib.Path(data_dir)), f"MNIST from $KERAS_DP_DATA_DIR ({data_dir})"
    keras_home = pathlib.Path(os.environ.get("KERAS_HOME", pathlib.Path.home() / ".keras"))
    cached = keras_home / "datasets" / FILENAME
    if cached.is_file():
        return cached, f"MNIST from Keras's cache ({cached})"
    downloaded = _download()
    if downloaded is not None:
        return downloaded, f"MNIST downloaded by Keras ({downloaded})"
    return BUNDLED_MNIST, BUNDLED_SOURCE


def _in_dir(path):
    return path / FILENAME if path.is_dir() else path


def _download(origin=MNIST_ORIGIN, file_hash=MNIST_SHA256):
    """Download `origin` into Keras's cache; the file, or None when that fails.

    Keras's "Downloading data from ..." line is held back: offline it would
    announce a download that then fails, and the caller says what it used.
    """
    import keras

    interactive = keras.config.is_interactive_logging_enabled()
    keras.config.disable_interactive_logging()
    try:
        return pathlib.Path(keras.utils.get_file(FILENAME, origin=origin, file_hash=file_hash))
    except Exception:  # No network, a proxy, a full disk: fall back, never fail.
        return None
    finally:
        if interactive:
            keras.config.enable_interactive_logging()
