"""The `keras-dp` command, run as a user runs it: in a fresh process."""

import os
import pty
import re
import select
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

from keras_dp import cli

EPOCH_TIME = (r"epoch (\d+) time [\d.]+ s: input [\d.]+ s, steps [\d.]+ s, callbacks "
              r"[\d.]+ s, validation [\d.]+ s, other [\d.]+ s; [\d,]+ samples/s, "
              r"[\d.]+ [kMGTP]?FLOP/s")
RESULT = (r"After (\d+) epochs?: val_loss ([\d.]+)  val_accuracy ([\d.]+) "
          r"\(on the (\d+) test images\)")


def run_cli(*args, timeout=300, cwd=None, env=None):
    return subprocess.run(
        [sys.executable, "-m", "keras_dp", *args], cwd=cwd,
        capture_output=True, text=True, timeout=timeout, env=env or dict(os.environ),
    )


def offline_environment(tmp_path):
    """A fresh machine without network: no data directory, an empty Keras
    cache, and downloads sent to a closed port on this machine."""
    env = {key: value for key, value in os.environ.items()
           if key.lower() not in ("keras_dp_data_dir", "xla_flags", "keras_backend", "no_proxy")}
    env["KERAS_HOME"] = str(tmp_path / "keras_home")
    for name in ("https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY"):
        env[name] = "http://127.0.0.1:9"
    return env


def run_in_terminal(args, cwd, env, timeout):
    """Run `keras-dp ARGS` with a pseudo-terminal as stdout and stderr; its exit code and output."""
    controller, terminal = pty.openpty()
    child = subprocess.Popen([sys.executable, "-m", "keras_dp", *args], cwd=cwd, env=env,
                             stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal)
    os.close(terminal)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([controller], [], [], 1.0)[0]:
                try:
                    chunk = os.read(controller, 65536)
                except OSError:  # the child closed the terminal: it has exited
                    break
                if not chunk:
                    break
                chunks.append(chunk)
        else:
            child.kill()
        return child.wait(timeout=30), b"".join(chunks).decode(errors="replace")
    finally:
        os.close(controller)


@pytest.mark.slow
def test_the_default_command_offline_reaches_090_on_the_bundled_subset(tmp_path):
    # `keras-dp train` as a newcomer types it, in a terminal, on a machine
    # with no network (no download) and no MNIST anywhere.
    code, out = run_in_terminal(["train"], cwd=tmp_path, env=offline_environment(tmp_path),
                                timeout=280)
    assert code == 0, out[-3000:]
    assert ("Data: the 5,000-image MNIST subset bundled with keras_dp (full MNIST was "
            "not found") in out
    assert "5000 training images; the 1000 test images are the validation data" in out
    assert "10 epochs (the default on the bundled subset, whose epochs are short)" in out
    assert "No GPU or TPU: training on 2 simulated CPU devices" in out
    assert "Mesh: 2 device(s) along axis 'batch', platform cpu" in out
    # One clear line about the data, not Keras's download notice or a warning.
    assert "Downloading data from" not in out and "Warning" not in out
    # Each epoch's time line starts a line of its own, after the finished
    # bar, and the bar is not drawn again after it.
    lines = re.sub(r"\x1b\[[0-9;]*m", "", out).replace("\r\n", "\n").split("\n")
    times = [index for index, line in enumerate(lines) if re.fullmatch(" " * 2 + EPOCH_TIME, line)]
    assert [re.fullmatch("  " + EPOCH_TIME, lines[i]).group(1) for i in times] == [
        str(epoch) for epoch in range(1, 11)]
    for index in times:
        assert re.search(r"79/79 .*val_accuracy: [\d.]+ - val_loss: [\d.]+ *$", lines[index - 1])
        assert lines[index + 1].startswith(("Epoch ", "After 10 epochs"))
    result = re.search(RESULT, out)
    assert result.group(1) == "10" and result.group(4) == "1000"
    assert float(result.group(3)) >= 0.90
    assert (tmp_path / "keras_dp_output" / "convnet.keras").stat().st_size > 100_000
    assert (tmp_path / "keras_dp_output" / "training_curves.png").read_bytes()[:4] == b"\x89PNG"


def test_the_png_gains_a_throughput_panel_of_the_timings(tmp_path):
    pytest.importorskip("matplotlib")
    from keras_dp.cli import plots

    parts = {"input_s": 0.5, "steps_s": 8.0, "callbacks_s": 0.25, "validation_s": 1.0,
             "other_s": 0.25}
    timings = [{"epoch": epoch, **parts, "samples_per_s": rate}
               for epoch, rate in enumerate([500.0, 900.0])]
    data = plots.throughput_data(timings)
    assert data == {"epoch": [1, 2], "samples_per_s": [500.0, 900.0],
                    **{part: [seconds, seconds] for part, seconds in parts.items()}}
    history = {"loss": [1.0, 0.5], "val_loss": [1.1, 0.6], "accuracy": [0.6, 0.8]}
    assert plots.plot_history(history, tmp_path / "curves.png", timings=timings)
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_one_epoch_is_ticked_as_epoch_1_only():
    pytest.importorskip("matplotlib")
    from keras_dp.cli import plots

    ticks = plots.epoch_locator().tick_values(0.945, 1.055)  # the view around one point
    assert [tick for tick in ticks if 0.945 <= tick <= 1.055] == [1.0]
    assert list(plots.epoch_locator().tick_values(1, 3)) == [1.0, 2.0, 3.0]


def small_mnist(directory, train, test):
    """An mnist.npz of the bundled subset's first `train` and `test` images, in `directory`."""
    from keras_dp import datasets

    (x, y), (x_test, y_test) = datasets.load_mnist(datasets.BUNDLED_MNIST)
    directory.mkdir(parents=True, exist_ok=True)
    np.savez(directory / "mnist.npz", x_train=x[:train], y_train=y[:train],
             x_test=x_test[:test], y_test=y_test[:test])
    return directory


@pytest.mark.slow  # 16 s; the terminal run checks the report in CI
def test_into_a_log_file_each_epoch_is_one_line_and_a_profile_is_written(tmp_path):
    result = run_cli(
        "train", "--epochs", "2", "--cpu-devices", "2",
        "--data-dir", str(small_mnist(tmp_path / "data", 640, 256)),
        "--output-dir", str(tmp_path), "--profile", str(tmp_path / "profile"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    # Not a terminal: Keras's line per epoch (verbose 2), no redrawn bar.
    assert not re.search(r"[\r\b\x1b]", out)
    assert "cpu:0: rows 0-31 | cpu:1: rows 32-63" in out
    assert re.search(r"^Training data: 640 rows, [\d.]+ KiB, kept on the devices for the fit: "
                     r"a full copy on each of the 2 ", out, flags=re.M)
    bars = re.findall(r"^10/10 - .* - accuracy: ([\d.]+) - loss: ([\d.]+) - "
                      r"val_accuracy: ([\d.]+) - val_loss: ([\d.]+)$", out, flags=re.M)
    assert len(bars) == 2 and float(bars[1][1]) < float(bars[0][1])
    assert re.findall("^  " + EPOCH_TIME + "$", out, flags=re.M) == ["1", "2"]
    result_line = re.search(RESULT, out)
    # The final scores are the last epoch's val_ logs, under the same names.
    assert result_line.group(2) == bars[1][3] and result_line.group(3) == bars[1][2]
    assert result_line.group(4) == "256"
    assert any((tmp_path / "profile").rglob("*.xplane.pb"))
    # It says where the trace went (it said nothing).
    assert (f"Profile: a jax.profiler trace of 5 calls of epoch 1 is in {tmp_path / 'profile'} "
            "(plugins/profile/<run>/*.xplane.pb") in out
    model = keras.saving.load_model(tmp_path / "convnet.keras")
    assert model.count_params() == 49_378


def test_help_and_argument_errors_load_neither_keras_nor_jax():
    script = (
        "import sys\n"
        "from keras_dp import cli\n"
        "for argv in (['--help'], ['train', '--help'], ['train', '--epochs', '0']):\n"
        "    try:\n"
        "        cli.main(argv)\n"
        "    except SystemExit as exit:\n"
        "        print('exit', exit.code)\n"
        "heavy = ('keras', 'jax', 'tensorflow', 'matplotlib')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=60, env={key: value for key, value in os.environ.items()
                                                 if key != "KERAS_BACKEND"})
    assert result.stdout.count("exit 0") == 2 and "exit 2" in result.stdout
    assert result.stdout.strip().endswith("[]"), result.stdout[-500:]
    assert "argument --epochs: must be at least 1, got 0" in result.stderr


@pytest.mark.parametrize("argv, message", [
    (["train", "--epochs", "0"], "argument --epochs: must be at least 1, got 0"),
    (["train", "--batch-size", "0"], "argument --batch-size: must be at least 1, got 0"),
    (["train", "--batch-size", "x"], "argument --batch-size: expected a whole number, got 'x'"),
    (["train", "--learning-rate", "0"], "argument --learning-rate: must be above 0, got 0.0"),
    (["train", "--cpu-devices", "-1"], "argument --cpu-devices: must be at least 1, got -1"),
    (["train", "--ensemble", "0"], "argument --ensemble: must be at least 1, got 0"),
    (["train", "--train-samples", "0"], "argument --train-samples: must be at least 1, got 0"),
    (["launch", "--processes", "0"], "argument --processes: must be at least 1, got 0"),
    # Before, accepted: the processes joined on some other port than the one named.
    (["launch", "--port", "99999", "--", "train"],
     "argument --port: must be a TCP port, 1 to 65535, got 99999"),
    # Before, a traceback: ValueError, or Popen's FileNotFoundError from the first child.
    (["launch"], "No command to launch. Put it after `--`"),
    (["launch", "--", "no_such_program_h58"],
     "Cannot launch 'no_such_program_h58': it is neither a keras-dp command"),
    (["launch", "--", "no_such_file_h58.py"], "No Python file 'no_such_file_h58.py' to launch"),
    (["train", "--bogus"], "unrecognized arguments: --bogus"),
    (["train", "--data-on-device", "yes"], "invalid choice: 'yes'"),
    (["train", "--data-dir", "/no/such/dir"], "--data-dir: no MNIST file at /no/such/dir."),
    (["train", "--ensemble", "2", "--data-on-device", "true"],
     "--data-on-device applies to one model's training, not to --ensemble"),
    (["train", "--ensemble", "2", "--plot-path", "c.png"], "--plot-path applies to one model"),
    (["train", "--ensemble", "2", "--profile", "trace"], "--profile applies to one model"),
    (["train", "--ensemble", "3", "--cpu-devices", "2"],
     "--ensemble 3 does not fit --cpu-devices 2: every device holds the same number"),
])
def test_bad_arguments_fail_with_usage_before_anything_runs(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_python_file_that_is_not_executable_is_launched_with_this_python(tmp_path):
    # `keras-dp launch --processes 2 script.py` failed with Popen's
    # "PermissionError: [Errno 13] Permission denied: 'script.py'", a traceback.
    script = tmp_path / "script.py"
    script.write_text("import os, sys\n"
                      "print('ran', os.environ['KERAS_DP_PROCESS_ID'], sys.argv[1:],"
                      " sys.executable)\n")
    result = subprocess.run([sys.executable, "-m", "keras_dp", "launch", "--processes", "2",
                             str(script), "--flag"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    for index in range(2):
        assert f"[process {index}] ran {index} ['--flag'] {sys.executable}" in result.stdout


def test_an_ensemble_across_processes_fails_with_usage_before_joining(monkeypatch, capsys):
    monkeypatch.setenv("KERAS_DP_COORDINATOR", "127.0.0.1:1")  # nothing listens: never joined
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--ensemble", "2"])
    assert exit_info.value.code == 2
    assert "--ensemble trains in one process" in capsys.readouterr().err


def test_cpu_devices_must_be_positive_and_set_before_jax_starts(monkeypatch):
    with pytest.raises(ValueError, match="at least 1"):
        cli.defaults.use_cpu_devices(0)
    import jax
    jax.devices()  # the test process's backend is running
    with pytest.raises(RuntimeError, match="already started.*before starting Python"):
        cli.defaults.use_cpu_devices(2)


def test_the_default_cpu_device_count_keeps_a_count_already_set():
    env = {"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"}
    assert cli.defaults.default_cpu_devices(env)
    assert env["XLA_FLAGS"] == ("--xla_cpu_enable_fast_math=false "
                                "--xla_force_host_platform_device_count=2")
    assert "JAX_PLATFORMS" not in env  # a GPU or TPU, if any, still wins
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    assert not cli.defaults.default_cpu_devices(env)
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"


@pytest.mark.slow
def test_main_job_on_full_mnist_reaches_094(tmp_path):
    # The bar: 2 epochs, 2 simulated devices, batch 64, Adam 1e-3.
    result = run_cli(
        "train", "--epochs", "2", "--cpu-devices", "2", "--verbose", "0",
        "--output-dir", str(tmp_path), timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    print(result.stdout)
    result_line = re.search(RESULT, result.stdout)
    assert result_line.group(4) == "10000" and float(result_line.group(3)) >= 0.94


def test_data_on_device_is_auto_true_or_false():
    parser = cli.build_parser()
    assert parser.parse_args(["train"]).data_on_device == "auto"
    assert parser.parse_args(["train", "--data-on-device", "false"]).data_on_device == "false"


def test_output_paths_that_cannot_be_written_fail_with_usage_before_anything_runs(
        tmp_path, capsys):
    # Before, each ran the whole training and then ended in a traceback
    # (NotADirectoryError, Keras's or matplotlib's ValueError), or failed
    # with profile_dir's ValueError as a traceback after Keras and JAX loaded.
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    cases = [
        (["--output-dir", str(a_file / "out")], f"--output-dir: cannot write {a_file}/out: "
                                                 f"{a_file} is not a directory."),
        (["--output-dir", str(a_file)], f"{a_file} exists and is not a directory"),
        (["--profile", str(a_file)], f"--profile: cannot write {a_file}"),
        (["--plot-path", str(a_file / "c.png")], f"--plot-path: cannot write {a_file}/c.png"),
        (["--model-path", str(tmp_path / "model")], "--model-path must end in .keras (or .h5"),
        (["--plot-path", str(tmp_path / "c.txt")], "--plot-path must end in .png"),
        (["--ensemble", "2", "--output-dir", str(a_file)], "--output-dir: cannot write"),
    ]
    # Were a check missing, the run would be short and write under tmp_path.
    small = ["train", "--epochs", "1", "--output-dir", str(tmp_path / "out"),
             "--data-dir", str(small_mnist(tmp_path / "data", 64, 64))]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            cli.main([*small, *argv])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err, argv
    (tmp_path / "m.keras").mkdir()
    with pytest.raises(SystemExit):
        cli.main([*small, "--model-path", str(tmp_path / "m.keras")])
    assert f"--model-path: {tmp_path / 'm.keras'} is a directory" in capsys.readouterr().err


def test_an_ensemble_that_does_not_fit_the_devices_found_fails_with_usage(
        tmp_path, monkeypatch, capsys):
    # Without --cpu-devices the device count is known once JAX starts (8
    # here); before, EnsembleTrainer's ValueError came out as a traceback.
    for name in ("TF_CPP_MIN_LOG_LEVEL", "TF_ENABLE_ONEDNN_OPTS", "XLA_FLAGS"):
        monkeypatch.setenv(name, os.environ.get(name, ""))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--ensemble", "12", "--output-dir", str(tmp_path),
                  "--data-dir", str(small_mnist(tmp_path / "data", 64, 64))])
    assert exit_info.value.code == 2
    assert ("--ensemble 12 does not fit the 8 cpu devices: every device holds the same "
            "number of members. Use at most 8 members, or a multiple of 8, or choose the "
            "device count with --cpu-devices N.") in capsys.readouterr().err


def test_the_ensembles_learning_rate_decays_as_the_help_says(tmp_path, monkeypatch):
    # `--learning-rate`'s help: "it decays to 0 along a cosine over the run";
    # the ensemble's members kept a constant rate.
    import keras_dp
    from keras_dp.cli import train

    built = []

    class Stop(Exception):
        pass

    def capture(build_model, members, seed):
        built.append(build_model())
        raise Stop

    monkeypatch.setattr(keras_dp, "EnsembleTrainer", capture)
    args = cli.build_parser().parse_args(
        ["train", "--ensemble", "2", "--epochs", "3", "--batch-size", "10",
         "--data-dir", str(small_mnist(tmp_path / "data", 95, 20))])
    with pytest.raises(Stop):
        train.train_ensemble(args)
    rate = built[0].optimizer.learning_rate
    schedule = built[0].optimizer._learning_rate
    assert isinstance(schedule, keras.optimizers.schedules.CosineDecay)
    assert schedule.decay_steps == 10 * 3 and float(rate) == pytest.approx(1e-3)


def test_ctrl_c_during_training_ends_with_one_line_and_saves_nothing(tmp_path):
    # Before: Python's traceback from wherever the signal landed, and, when
    # it landed in a compile, a SIGSEGV at exit in about half of the trials.
    import signal

    data = small_mnist(tmp_path / "data", 3200, 64)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # Python's own SIGINT handler, even where this run's SIGINT is ignored
    # (a job in the background of a shell without job control).
    start = ("import runpy, signal, sys; signal.signal(signal.SIGINT, "
             "signal.default_int_handler); sys.argv[0] = 'keras-dp'; "
             "runpy.run_module('keras_dp', run_name='__main__')")
    child = subprocess.Popen(
        [sys.executable, "-c", start, "train", "--epochs", "1", "--cpu-devices", "2",
         "--data-dir", str(data), "--output-dir", str(tmp_path / "out")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines = []
    for line in child.stdout:  # the report's last line before training
        lines.append(line)
        if line.startswith("Memory per device"):
            child.send_signal(signal.SIGINT)
            break
    out, err = child.communicate(timeout=120)
    assert child.returncode == 130, err[-3000:]
    assert "  1 epoch; Adam's" in "".join(lines)
    assert err == ("keras-dp train: stopped by Ctrl-C; nothing was saved (the model and the "
                   "training curves are written when training ends).\n")
    assert not (tmp_path / "out").exists()


def test_ctrl_c_while_saving_names_what_was_written_and_what_may_be_incomplete():
    assert cli.interrupted_message({"m.keras": True, "c.png": False}) == (
        "keras-dp train: stopped by Ctrl-C after training; wrote m.keras; c.png may be "
        "incomplete.")
    assert cli.interrupted_message({"m.keras": True, "c.png": True}) == (
        "keras-dp train: stopped by Ctrl-C after training; wrote m.keras, c.png.")


def test_cpu_device_environment_replaces_the_count_and_keeps_other_flags():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_dump_to=/tmp/x"}
    cli.defaults.cpu_device_environment(3, env)
    assert env["XLA_FLAGS"].split() == [
        "--xla_dump_to=/tmp/x", "--xla_force_host_platform_device_count=3"]
    assert env["JAX_PLATFORMS"] == "cpu"
    before = dict(os.environ)
    copy = cli.defaults.cpu_device_environment(2)  # a copy of os.environ, edited
    assert copy["XLA_FLAGS"].endswith("--xla_force_host_platform_device_count=2")
    assert dict(os.environ) == before
