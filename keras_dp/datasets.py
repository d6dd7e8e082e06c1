"""Datasets: MNIST from a path, a data directory, Keras's cache, or the bundle.

`load_mnist` looks, in order, at an explicit path, at
`$KERAS_DP_DATA_DIR/mnist.npz`, at Keras's cache (`~/.keras/datasets`), then
downloads with `keras.datasets.mnist.load_data()`. When all of these fail (no
network, no data directory) it falls back to the small real subset bundled in
the package (5,000 training and 1,000 test images) and warns that it did.
"""

import os
import pathlib
import warnings

import numpy as np

BUNDLED_MNIST = pathlib.Path(__file__).resolve().parent / "data" / "mnist_subset.npz"
FILENAME = "mnist.npz"


def load_mnist(path=None):
    """Return MNIST as `(x_train, y_train), (x_test, y_test)` numpy arrays.

    Images are `uint8` of shape `(n, 28, 28)`, labels `uint8` of shape
    `(n,)`, exactly as `keras.datasets.mnist.load_data()` returns them.

    Args:
        path: an `mnist.npz` file, or a directory holding one.

    Raises:
        FileNotFoundError: `path` was given but holds no `mnist.npz`.
    """
    return _read(find_mnist(path)[0])


def find_mnist(path=None):
    """Return `(file, description)` for the MNIST copy `load_mnist` would read."""
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
    warnings.warn(
        "Full MNIST was not found (no path, no $KERAS_DP_DATA_DIR, no Keras "
        "cache) and could not be downloaded; using the 5,000-image subset "
        "bundled with keras_dp. Set KERAS_DP_DATA_DIR to a directory with "
        "mnist.npz for the full dataset.",
        stacklevel=2,
    )
    return BUNDLED_MNIST, f"the MNIST subset bundled with keras_dp ({BUNDLED_MNIST.name})"


def _in_dir(path):
    return path / FILENAME if path.is_dir() else path


def _download():
    import keras

    try:
        return pathlib.Path(
            keras.utils.get_file(
                FILENAME,
                origin="https://storage.googleapis.com/tensorflow/tf-keras-datasets/mnist.npz",
                file_hash="731c5ac602752760c8e48fbffcf8c3b850d9dc2a2aedcf2cc48468fc17b673d1",
            )
        )
    except Exception:  # No network, a proxy, a full disk: fall back, never fail.
        return None


def _read(file):
    with np.load(file, allow_pickle=False) as data:
        return (data["x_train"], data["y_train"]), (data["x_test"], data["y_test"])
