"""The `keras-dp` command, run as a user runs it: in a fresh process."""

import os
import re
import subprocess
import sys

import pytest

from keras_dp import cli


def run_cli(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "keras_dp", *args],
        capture_output=True, text=True, timeout=timeout, env=dict(os.environ),
    )


def test_train_prints_devices_epochs_and_test_accuracy_and_saves(tmp_path):
    result = run_cli(
        "train", "--epochs", "2", "--cpu-devices", "2", "--train-samples", "6400",
        "--verbose", "0", "--output-dir", str(tmp_path), "--profile", str(tmp_path / "profile"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "Mesh: 2 device(s) along axis 'batch', platform cpu" in out
    assert "cpu:0: rows 0-31 | cpu:1: rows 32-63" in out
    # 6,400 of full MNIST, or all 5,000 of the bundled subset without it.
    assert re.search(r"(6400 training and 10000|5000 training and 1000) test images", out)
    epochs = re.findall(r"epoch (\d)/2: loss ([\d.]+)  accuracy ([\d.]+)  ([\d.]+) s  ([\d,]+) samples/s", out)
    assert [e[0] for e in epochs] == ["1", "2"]
    assert float(epochs[1][1]) < float(epochs[0][1])
    assert float(epochs[1][2]) > 0.6
    times = re.findall(r"epoch (\d) time [\d.]+ s: input [\d.]+ s, steps [\d.]+ s, callbacks "
                       r"[\d.]+ s, validation [\d.]+ s, other [\d.]+ s; [\d,]+ samples/s", out)
    assert times == ["1", "2"]
    assert any((tmp_path / "profile").rglob("*.xplane.pb"))
    # After 200 steps the BatchNorm moving statistics (momentum 0.99) are
    # still far off, so test accuracy is low here, as under model.fit; the
    # full run (a slow test) reaches 0.94.
    assert 0.0 <= float(re.search(r"Test: loss [\d.]+  accuracy ([\d.]+)", out).group(1)) <= 1.0
    assert (tmp_path / "convnet.keras").stat().st_size > 100_000
    assert (tmp_path / "training_curves.png").read_bytes()[:4] == b"\x89PNG"


def test_an_unknown_option_fails_with_usage(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--bogus"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_cpu_devices_must_be_positive_and_set_before_jax_starts(monkeypatch):
    with pytest.raises(ValueError, match="at least 1"):
        cli.use_cpu_devices(0)
    import jax
    jax.devices()  # the test process's backend is running
    with pytest.raises(RuntimeError, match="already started.*before starting Python"):
        cli.use_cpu_devices(2)


@pytest.mark.slow
def test_main_job_on_full_mnist_reaches_094(tmp_path):
    # The bar: 2 epochs, 2 simulated devices, batch 64, Adam 1e-3.
    result = run_cli(
        "train", "--epochs", "2", "--cpu-devices", "2", "--verbose", "0",
        "--output-dir", str(tmp_path), timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    print(result.stdout)
    accuracy = float(re.search(r"Test: loss [\d.]+  accuracy ([\d.]+)", result.stdout).group(1))
    assert accuracy >= 0.94


def test_data_on_device_is_auto_true_or_false(capsys):
    parser = cli.build_parser()
    assert parser.parse_args(["train"]).data_on_device == "auto"
    assert parser.parse_args(["train", "--data-on-device", "false"]).data_on_device == "false"
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--data-on-device", "yes"])
    assert "invalid choice: 'yes'" in capsys.readouterr().err
