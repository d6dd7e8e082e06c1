"""load_mnist: path, data directory, Keras cache, download, bundled subset."""

import os

import numpy as np
import pytest

from keras_dp import datasets


@pytest.fixture
def no_download(monkeypatch, tmp_path):
    monkeypatch.delenv("KERAS_DP_DATA_DIR", raising=False)
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras_home"))
    monkeypatch.setattr(datasets, "_download", lambda: None)


@pytest.mark.skipif(not os.environ.get("KERAS_DP_DATA_DIR"), reason="needs full MNIST")
def test_full_mnist_from_the_data_dir():
    (x, y), (x_test, y_test) = datasets.load_mnist()
    assert x.shape == (60000, 28, 28) and x.dtype == np.uint8
    assert x_test.shape == (10000, 28, 28)
    assert np.bincount(y_test).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


def test_explicit_path_file_or_directory(tmp_path):
    file, _ = datasets.find_mnist()
    assert datasets.find_mnist(file)[0] == file
    assert datasets.find_mnist(file.parent)[0] == file
    with pytest.raises(FileNotFoundError, match="No MNIST file at"):
        datasets.load_mnist(tmp_path)


def test_keras_cache_is_used(no_download, tmp_path):
    cache = tmp_path / "keras_home" / "datasets"
    cache.mkdir(parents=True)
    (x, y), _ = datasets.load_mnist(datasets.BUNDLED_MNIST)
    np.savez(cache / "mnist.npz", x_train=x[:10], y_train=y[:10], x_test=x[:5], y_test=y[:5])
    file, source = datasets.find_mnist()
    assert file == cache / "mnist.npz" and "Keras's cache" in source
    assert datasets.load_mnist()[0][0].shape == (10, 28, 28)


def test_falls_back_to_the_bundled_subset_and_says_so_in_one_line(no_download, caplog):
    (x, y), (x_test, y_test) = datasets.load_mnist()
    assert x.shape == (5000, 28, 28) and x_test.shape == (1000, 28, 28)
    assert set(np.unique(y)) == set(range(10))
    assert [record.getMessage() for record in caplog.records] == [
        "Using the 5,000-image MNIST subset bundled with keras_dp (full MNIST was not "
        "found: no path, no $KERAS_DP_DATA_DIR, none in Keras's cache, and the download "
        "failed). Set KERAS_DP_DATA_DIR to a directory with mnist.npz for the full "
        "60,000 training images."
    ]
    assert caplog.records[0].levelname == "WARNING"
    assert datasets.find_mnist() == (datasets.BUNDLED_MNIST, datasets.BUNDLED_SOURCE)
