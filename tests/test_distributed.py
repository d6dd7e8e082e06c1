"""Many processes: JAX's multi-controller runtime, on this machine.

Each multi-process test starts real processes joined over loopback (gloo
collectives between simulated CPU devices), through `keras-dp launch` or by
hand, under a hard time limit that kills every process it started.
"""

import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from keras_dp import distributed
from keras_dp.cli.launch import child_environment

WORKER = pathlib.Path(__file__).parent / "scripts" / "distributed_worker.py"
LIMIT = 240


def run(args, env=None, timeout=LIMIT):
    """Run a command in its own session; on timeout, kill the whole session."""
    process = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=env or dict(os.environ), start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        pytest.fail(f"{args} did not finish within {timeout} s")
    return process.returncode, output


def launch(processes, cpu_devices, *command):
    return run([sys.executable, "-m", "keras_dp", "launch", "--processes", str(processes),
                "--cpu-devices", str(cpu_devices), "--", *command])


def worker(task, out, *extra):
    return [sys.executable, str(WORKER), task, "--out", str(out), *extra]


def test_two_processes_of_two_devices_equal_one_process_of_four(tmp_path):
    code, output = launch(2, 2, *worker("fit", tmp_path))
    assert code == 0, output[-3000:]
    assert output.count("done fit") == 2
    # One progress bar, from process 0.
    assert "[process 0] \x1b[1m16/16" in output and "[process 1] \x1b[1m" not in output
    reference_env = dict(os.environ, JAX_PLATFORMS="cpu",
                         XLA_FLAGS="--xla_force_host_platform_device_count=4")
    code, output = run(worker("reference", tmp_path), env=reference_env)
    assert code == 0, output[-3000:]
    first, second, reference = (np.load(tmp_path / f"{name}.npz")
                                for name in ("process0", "process1", "reference"))
    assert int(reference["devices"]) == 4
    assert int(first["iterations"]) == int(reference["iterations"]) == 16
    np.testing.assert_allclose(first["loss"], reference["loss"], rtol=1e-5)
    for name in first.files:
        np.testing.assert_array_equal(first[name], second[name])  # bitwise, every array
        if name.startswith("arr_"):
            np.testing.assert_allclose(first[name], reference[name], rtol=1e-5, atol=1e-6)


def test_uneven_shares_run_the_same_steps_and_use_every_row_once(tmp_path):
    # 1,000 and 1,003 rows at 10 rows per process and step: process 0 is
    # out after 100 steps and sends padding for step 101, which has the
    # other's last 3 rows. Labels are row ids; a metric counts each id seen.
    code, output = launch(2, 2, *worker("uneven", tmp_path, "--batch-size", "20"))
    assert code == 0, output[-3000:]
    first, second = (np.load(tmp_path / f"process{i}.npz") for i in range(2))
    assert int(first["iterations"]) == int(second["iterations"]) == 101
    np.testing.assert_array_equal(first["counts"], np.ones(2003))
    np.testing.assert_array_equal(first["counts"], second["counts"])
    # predict returns each process's outputs for its own rows, in order.
    assert first["predictions"].shape == (1000, 1) and second["predictions"].shape == (1003, 1)
    for result in (first, second):
        np.testing.assert_allclose(result["predictions"], result["expected"], rtol=1e-6)
        # steps_per_execution > 1 and a global batch that does not divide
        # by the process count are refused, with errors that say so.
        assert result["refused"].tolist() == [True, True]


@pytest.mark.parametrize("victim", [0, 1])
def test_a_killed_process_makes_the_other_fail_within_bounded_time(tmp_path, victim):
    # Killing process 1 leaves process 0 waiting in a collective until the
    # coordinator misses its heartbeats (KERAS_DP_HEARTBEAT_TIMEOUT, 20 s by
    # default); killing process 0 takes the coordinator down with it.
    address = f"127.0.0.1:{_free_port()}"
    logs = [tmp_path / f"process{index}.log" for index in range(2)]
    processes = [
        subprocess.Popen(worker("forever", tmp_path),
                         env=child_environment(index, 2, address, cpu_devices=2),
                         stdout=log.open("w"), stderr=subprocess.STDOUT,
                         start_new_session=True)
        for index, log in enumerate(logs)
    ]
    try:
        deadline = time.monotonic() + LIMIT
        while "training" not in logs[victim].read_text():  # steps are running
            assert processes[victim].poll() is None, logs[victim].read_text()[-3000:]
            assert time.monotonic() < deadline, "the workers never started training"
            time.sleep(0.2)
        processes[victim].kill()
        killed = time.monotonic()
        survivor = processes[1 - victim]
        code = survivor.wait(timeout=90)  # TimeoutExpired here is the failure
        assert code != 0
        print(f"survivor exited with {code} after {time.monotonic() - killed:.1f} s")
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def test_only_process_0_writes_the_model_and_plot(tmp_path):
    code, output = launch(2, 1, "train", "--epochs", "1", "--train-samples", "512",
                          "--verbose", "0", "--output-dir", str(tmp_path))
    assert code == 0, output[-3000:]
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "convnet.keras", "training_curves.png"
    ]
    assert "[process 0] After 1 epoch: val_loss" in output
    assert "[process 1] Test" not in output and "[process 1] epoch" not in output
    assert "[process 0] 2 processes; each reads 1/2 of the data and 32 rows" in output


def test_launch_fails_with_the_failing_child_and_stops_the_others():
    script = ("import os, sys, time\n"
              "if os.environ['KERAS_DP_PROCESS_ID'] == '1': sys.exit(3)\n"
              "time.sleep(120)\n")
    start = time.monotonic()
    code, output = launch(2, 1, sys.executable, "-c", script)
    assert code == 3
    assert time.monotonic() - start < 60  # process 0 was stopped, not waited for


def test_initialize_after_jax_started_says_to_call_it_first():
    jax.devices()  # this test process's backend is running
    with pytest.raises(RuntimeError, match="already started.*initialize\\(\\) first"):
        distributed.initialize("127.0.0.1:1", 2, 0)


def _free_port():
    from keras_dp.cli.launch import _free_port as free_port

    return free_port()
