"""Many processes: JAX's multi-controller runtime, on this machine.

Each multi-process test starts real processes joined over loopback (gloo
collectives between simulated CPU devices), through `keras-dp launch` or by
hand, under a hard time limit that kills every process it started.
"""

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import keras_dp
from keras_dp import distributed
from keras_dp.cli.launch import child_environment
from conftest import assert_close_to_scale
from conftest import sigterm_stops

WORKER = pathlib.Path(__file__).parent / "scripts" / "distributed_worker.py"
sys.path.insert(0, str(WORKER.parent))
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
    out.mkdir(parents=True, exist_ok=True)
    return [sys.executable, str(WORKER), task, "--out", str(out), *extra]


def run_pair(out, *extra, env=None, timeout=LIMIT, command=None):
    """Start 2 processes of 2 devices by hand; return both exit codes and logs.

    They run `command` (default: the worker's `fit` with `extra`).
    """
    address = f"127.0.0.1:{_free_port()}"
    command = command or worker("fit", out, *extra)
    logs = [out / f"process{index}.log" for index in range(2)]
    processes = [
        subprocess.Popen(command,
                         env=dict(child_environment(index, 2, address, cpu_devices=2),
                                  **(env or {})),
                         stdout=log.open("w"), stderr=subprocess.STDOUT,
                         start_new_session=True)
        for index, log in enumerate(logs)
    ]
    try:
        deadline = time.monotonic() + timeout
        codes = [process.wait(timeout=max(1, deadline - time.monotonic()))
                 for process in processes]  # TimeoutExpired here is the failure
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return codes, [log.read_text() for log in logs]


def weights(result):
    return [result[name] for name in result.files if name.startswith("arr_")]


def load(out):
    return [np.load(out / f"process{index}.npz") for index in range(2)]


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory):
    """2 processes x 2 devices, 3 epochs, steps_per_execution=4, look-ahead on."""
    out = tmp_path_factory.mktemp("unbroken")
    code, output = launch(2, 2, *worker("fit", out, "--extras"))
    assert code == 0, output[-3000:]
    return out, output


@pytest.fixture(scope="module")
def one_process_of_four():
    """The reference: one process on 4 devices, the same global batches, unshuffled."""
    from many_hosts_data import make_model, rows_of

    rows = 798
    x, y = rows_of(np.arange(rows), rows)
    model = make_model(rows)
    keras_dp.fit_sharded(model, x, y, batch_size=64, epochs=3, shuffle=False, verbose=0,
                         devices=jax.devices()[:4])
    return model.get_weights()


def test_two_processes_with_k_steps_and_look_ahead_equal_one_process_of_four(
        unbroken, one_process_of_four):
    # 798 rows, 64 per step: 12 full steps, then 30 rows on process 0 and
    # none on process 1, whose share runs out a step early (414 and 384 rows).
    out, output = unbroken
    first, second = load(out)
    assert int(first["iterations"]) == int(second["iterations"]) == 3 * 13
    for name in first.files:
        if name not in ("predictions", "expected", "description"):
            np.testing.assert_array_equal(first[name], second[name])  # bitwise, every array
    for mine, reference in zip(weights(first), one_process_of_four):
        assert_close_to_scale(mine, reference)
    np.testing.assert_array_equal(first["counts"], np.ones(798))  # every row once, last epoch
    # Host round trips per epoch: one for the epoch's plan of rows, one to
    # agree whether to read the model, and one after each epoch but the last
    # to agree whether to stop; never one per step (it was 14 per epoch of
    # 13 steps, plus a broadcast of the whole state). A dataset's counts go
    # 8 steps at a time: 3 rounds for its 13 steps, plus one. And one round
    # per fit compares the processes' settings (3 fits in all: 3 epochs).
    assert round(float(first["rounds_per_epoch"]) * 3) == 3 * 2 + 2 + 1
    assert round(float(first["dataset_rounds_per_epoch"]) * 3) == 3 * 4 + 2 + 1
    # After the first epoch's start no blocking host collective runs (no
    # broadcast_one_to_all, process_allgather or sync_global_devices): the
    # state stays on the devices and the metrics' reset values are placed
    # locally (they were broadcast at every epoch's start before). So with
    # K=4, an epoch of 13 steps (4 calls) makes 2 host round trips, plus one
    # after each epoch but the last, and no collective of JAX's on the host.
    for result in (first, second):
        assert result["host_collectives_after_epoch_0"].tolist() == [0, 0, 0]
        assert result["host_collectives"][0] > 0  # counted: fit's start reads process 0's model
    # The same batches as a dataset train bitwise the same weights.
    np.testing.assert_array_equal(
        np.concatenate([np.ravel(w) for w in weights(first)]), first["dataset_weights"])
    # predict in K-step calls returns each process's own rows, in order.
    assert first["predictions"].shape == (414, 1) and second["predictions"].shape == (384, 1)
    for result in (first, second):
        assert_close_to_scale(result["predictions"], result["expected"])
        assert bool(result["refused"])  # a global batch that does not divide by 2
        assert bool(result["ensemble_refused"])  # up front, saying why
    # describe(), called on process 0 alone, shows the whole mesh, process by
    # process, with each one's host.
    import socket

    host = socket.gethostname()
    lines = str(first["description"]).splitlines()
    assert lines[0] == "Mesh: 4 device(s) along axis 'batch', platform cpu, 2 processes"
    for process in (0, 1):  # JAX numbers each process's CPU devices from its own base
        assert re.fullmatch(f"  process {process} on {re.escape(host)}: cpu:\\d+, cpu:\\d+",
                            lines[1 + process]), lines
    # One progress bar, from process 0.
    assert "[process 0] \x1b[1m13/13" in output and "[process 1] \x1b[1m" not in output


@pytest.mark.slow  # 30 s; the 2 x 2 test covers processes of several devices in CI
def test_four_processes_of_one_device_equal_one_process_of_four(tmp_path, one_process_of_four):
    code, output = launch(4, 1, *worker("fit", tmp_path))
    assert code == 0, output[-3000:]
    results = [np.load(tmp_path / f"process{index}.npz") for index in range(4)]
    for result in results[1:]:
        for mine, first in zip(weights(result), weights(results[0])):
            np.testing.assert_array_equal(mine, first)
    for mine, reference in zip(weights(results[0]), one_process_of_four):
        assert_close_to_scale(mine, reference)
    np.testing.assert_array_equal(results[0]["counts"], np.ones(798))


def checkpoint_steps(directory):
    """The checkpoints orbax committed, and anything else in the directory but its lock."""
    names = sorted(path.name for path in directory.iterdir() if path.name != ".keras_dp.lock")
    return [int(name) for name in names if name.isdigit()], [n for n in names if not n.isdigit()]


def test_sigterm_to_one_process_saves_every_process_at_one_step_and_resumes_bitwise(
        tmp_path, unbroken):
    checkpoints = tmp_path / "checkpoints"
    codes, logs = run_pair(tmp_path / "stopped", "--checkpoint-dir", str(checkpoints),
                           "--signal", "SIGTERM:1:1:5")
    assert codes == [143, 143], logs[1][-3000:]
    stops = [sigterm_stops(log) for log in logs]
    assert len(stops[0]) == 1 and stops[0] == stops[1], stops  # the same step in both
    [(epoch, steps_done)] = stops[0]
    assert (epoch, steps_done) > (1, 5)  # after the signal
    kept, others = checkpoint_steps(checkpoints)
    assert others == [] and len(kept) == 2  # complete checkpoints only, the stop newest
    code, output = launch(2, 2, *worker("fit", tmp_path / "resumed", "--checkpoint-dir",
                                        str(checkpoints)))
    assert code == 0, output[-3000:]
    resumed, _ = load(tmp_path / "resumed")
    assert resumed["first"][0] == epoch and resumed["first"][1] >= steps_done
    for mine, reference in zip(weights(resumed), weights(load(unbroken[0])[0])):
        np.testing.assert_array_equal(mine, reference)  # bitwise an unbroken run
    np.testing.assert_array_equal(resumed["counts"], np.ones(798))


@pytest.mark.slow  # 35 s; the SIGTERM resume runs in CI
def test_sigkill_of_one_process_resumes_from_the_last_complete_epoch_bitwise(
        tmp_path, unbroken):
    checkpoints = tmp_path / "checkpoints"
    codes, logs = run_pair(tmp_path / "killed", "--checkpoint-dir", str(checkpoints),
                           "--signal", "SIGKILL:1:1:5",
                           env={distributed.HEARTBEAT_ENV: "5"})
    assert codes[1] == -signal.SIGKILL and codes[0] == 75, logs[0][-3000:]
    # Said in keras_dp's one line (it was JAX's native abort and a C++ stack).
    assert ("keras_dp: process 1 stopped answering (JAX's coordination service heard no "
            "heartbeat for 5 s), so this process (process 0) ends now, with status 75. The "
            f"newest complete checkpoint, {checkpoints / '0'} (at the end of epoch 1), is "
            "intact") in logs[0], logs[0][-3000:]
    assert "Check failure" not in logs[0] and "fatal errors" not in logs[0]
    assert checkpoint_steps(checkpoints) == ([0], [])  # epoch 1's end; nothing partial
    code, output = launch(2, 2, *worker("fit", tmp_path / "resumed", "--checkpoint-dir",
                                        str(checkpoints)))
    assert code == 0, output[-3000:]
    resumed, _ = load(tmp_path / "resumed")
    assert resumed["first"].tolist() == [1, 3]  # epoch 2's first call of 4 steps
    for mine, reference in zip(weights(resumed), weights(load(unbroken[0])[0])):
        np.testing.assert_array_equal(mine, reference)


# In CI, tests/test_preemption.py's fixed soak kills process 0 in a save
# (heartbeat cut to 5 s); here with the default 20 s, behind --runslow.
@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1])
def test_a_killed_process_ends_the_other_with_one_line_within_the_heartbeat(tmp_path, victim):
    # The survivor learns from JAX's coordination service, which misses the
    # killed one's heartbeats (KERAS_DP_HEARTBEAT_TIMEOUT, 20 s by default),
    # and ends with keras_dp's line naming it. Before, JAX aborted it with a
    # C++ check-failure stack; when process 0 was killed, at once, since the
    # service ran in it (now it runs in a process of its own).
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
        elapsed = time.monotonic() - killed
        log = logs[1 - victim].read_text()
        assert code == 75, log[-3000:]
        assert (f"keras_dp: process {victim} stopped answering (JAX's coordination service "
                f"heard no heartbeat for 20 s), so this process (process {1 - victim}) ends "
                "now, with status 75. No checkpoint was saved") in log, log[-3000:]
        assert "Check failure" not in log and "Traceback" not in log
        assert elapsed < 20 + 5, elapsed  # the heartbeat timeout, and the watcher's poll
        print(f"survivor exited with {code} after {elapsed:.1f} s")
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.mark.slow  # the CLI across processes: 20 s
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


def test_the_processes_the_tests_start_import_this_checkouts_keras_dp(tmp_path):
    # A worker script's sys.path starts with its own directory: without the
    # PYTHONPATH that conftest sets, it imported the installed keras_dp (in a
    # git worktree, another tree's), and these tests ran that code.
    found = subprocess.run(
        [sys.executable, "-c",
         "import importlib.util; print(importlib.util.find_spec('keras_dp').origin)"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    assert found == str(pathlib.Path(__file__).resolve().parents[1] / "keras_dp" / "__init__.py")


def test_a_bad_agreement_timeout_is_refused_naming_the_variable(monkeypatch):
    from keras_dp.multihost import agreement

    monkeypatch.delenv("KERAS_DP_AGREEMENT_TIMEOUT", raising=False)
    assert agreement.timeout() == 300
    monkeypatch.setenv("KERAS_DP_AGREEMENT_TIMEOUT", "2.5")
    assert agreement.timeout() == 2.5
    for text in ("0", "soon"):
        monkeypatch.setenv("KERAS_DP_AGREEMENT_TIMEOUT", text)
        with pytest.raises(ValueError, match=f"KERAS_DP_AGREEMENT_TIMEOUT is a number of "
                                             f"seconds above 0. Received: "
                                             f"KERAS_DP_AGREEMENT_TIMEOUT='{text}'"):
            agreement.timeout()


def test_the_same_arrays_on_every_process_are_read_globally_and_a_same_dataset_warned_of(
        recwarn):
    # The same whole arrays on every process trained each row P times per
    # epoch (a warning said so); now they are the global data, each process
    # reading its part of every global batch. The same dataset is still
    # warned of. Here the settings round's values of 2 processes are made in
    # one: the whole data on both, then shares; arrays, then lists of batches.
    from keras_dp.multihost import agreement
    from keras_dp import sources as pipeline

    x, y = np.arange(40.0).reshape(20, 2), np.arange(20.0)
    arrays = lambda x, y: dict(x=x, y=y, batch_size=4)
    listed = lambda x, y: dict(x=[(x[i:i + 4], y[i:i + 4]) for i in range(0, len(x), 4)])

    def round_of(*shares, kind=arrays, process=1):
        sources = [pipeline.make_batches(**kind(*share)) for share in shares]
        found = [agreement._fingerprint(source, [0, 1]) for source in sources]
        with mock_process(process):
            agreement._check([[0, agreement._code(code)] for _, code in found], found[1:],
                             "fit")
        return sources[1]

    mine = round_of((x, y), (x, y))  # process 1's source: 4-row batches, now global
    assert (mine.global_order, mine.part, mine.batch_size) == ("arrays", (1, 2), 8)
    assert mine.planned_rows() == [4, 4, 0] and mine.steps == 3  # 20 rows, 8 a global step
    np.testing.assert_array_equal(np.concatenate([b[1] for b in mine.epoch(0)]),
                                  [4, 5, 6, 7, 12, 13, 14, 15])  # rows 4-7 of each of 8
    assert not recwarn.list
    with pytest.warns(UserWarning, match="The first training batch is the same on all 2 "
                                         "processes.*each row is trained 2 times per epoch"
                                         ".*keras_dp.shard_for_processes"):
        round_of((x, y), (x, y), kind=listed, process=0)
    for kind in (arrays, listed):
        shares = round_of((x[:10], y[:10]), (x[10:], y[10:]), kind=kind)  # each its own
        assert shares.global_order is None and getattr(shares, "part", None) is None
        round_of((x[:10], y[:10]), (x[:10], y[:10] + 1), kind=kind)  # the same x, other labels
    assert not recwarn.list


def mock_process(index):
    from unittest import mock

    return mock.patch("jax.process_index", lambda: index)


def test_two_processes_passing_the_same_arrays_read_them_globally(tmp_path):
    # The round above, across 2 real processes: the same 16 rows on both are
    # 2 global steps of 8 (each process 4 rows of each), not 4 steps of
    # each process's 16 rows; the same batches are warned of on process 0.
    codes, logs = run_pair(tmp_path, timeout=90,
                           command=[sys.executable, str(MISMATCH_WORKER), "same_rows"])
    assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    expected = ("WARNED whole arrays 0 STEPS 2\nWARNED whole batches {0} STEPS 4\n"
                "WARNED shares arrays 0 STEPS 4\nWARNED shares batches 0 STEPS 4\n")
    assert expected.format(1) in logs[0], logs[0][-3000:]
    assert expected.format(0) in logs[1], logs[1][-3000:]


def test_initialize_after_jax_started_says_to_call_it_first():
    jax.devices()  # this test process's backend is running
    with pytest.raises(RuntimeError, match="already started.*initialize\\(\\) first"):
        distributed.initialize("127.0.0.1:1", 2, 0)


def test_a_launched_process_that_never_called_initialize_is_refused_before_training(
        monkeypatch):
    # Under `keras-dp launch` without initialize(), each process ran alone on
    # its 2 devices: two unrelated trainings, both writing the same files.
    monkeypatch.setenv("KERAS_DP_COORDINATOR", "127.0.0.1:1")
    monkeypatch.setenv("KERAS_DP_NUM_PROCESSES", "2")
    monkeypatch.setenv("KERAS_DP_PROCESS_ID", "1")
    import keras

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    message = ("started as process 1 of 2 .*JAX runs it alone: "
               "keras_dp.distributed.initialize\\(\\) was not called")
    for start in (lambda: keras_dp.make_mesh(), lambda: keras_dp.ShardedTrainer(model),
                  lambda: keras_dp.fit_sharded(model, np.zeros((4, 3)), np.zeros(4))):
        with pytest.raises(RuntimeError, match=message):
            start()
    monkeypatch.setenv("KERAS_DP_NUM_PROCESSES", "1")  # `keras-dp launch --processes 1`
    assert keras_dp.make_mesh().devices.size == len(jax.devices())


@pytest.mark.slow
def test_a_peer_that_never_arrives_raises_a_python_timeout_naming_the_coordinator():
    # Real rendezvous for 2 processes, each on its own port so that neither
    # peer ever arrives: JAX alone would abort both natively at its deadline.
    # Process 0 runs the coordinator, so its port answers; for process 1
    # nothing listens.
    script = (
        "import sys, time\n"
        "from keras_dp import distributed\n"
        "start = time.monotonic()\n"
        "try:\n"
        "    distributed.initialize(sys.argv[1], 2, int(sys.argv[2]), initialization_timeout=3)\n"
        "except TimeoutError as error:\n"
        "    print('TimeoutError', round(time.monotonic() - start), error)\n"
        "    sys.exit(7)\n"
    )
    addresses = [f"127.0.0.1:{_free_port()}" for _ in range(2)]
    processes = [subprocess.Popen(
        [sys.executable, "-c", script, address, str(process_id)], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True)
        for process_id, address in enumerate(addresses)]
    try:
        outputs = [process.communicate(timeout=90)[0] for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    for process_id, (process, output) in enumerate(zip(processes, outputs)):
        assert process.returncode == 7, output
        line = next(line for line in output.splitlines() if line.startswith("TimeoutError"))
        assert f"process {process_id} of 2 waited 3 s at {addresses[process_id]}" in line
        assert int(line.split()[1]) <= 10  # keras_dp's 3 s, not JAX's deadline
        assert ("accepts connections" if process_id == 0
                else "Nothing accepts connections") in line


def _free_port():
    from keras_dp.cli.launch import _free_port as free_port

    return free_port()


MISMATCH_WORKER = WORKER.parent / "mismatch_worker.py"
AGREE = ("Every process must run the same fit (the same arguments, model and optimizer), "
         "each with its own share of the data")


@pytest.mark.slow  # 9 s: moved out of CI to keep the default run under 10 minutes
def test_fits_that_differ_between_processes_fail_on_every_process_and_stops_agree(tmp_path):
    # Each case hung (epochs, no rows, stop: until killed), aborted in gloo
    # (width) or trained on batches neither process asked for (batch_size:
    # 4 rows from one, 8 from the other) before the processes compared them.
    codes, logs = run_pair(tmp_path, timeout=90,
                           command=[sys.executable, str(MISMATCH_WORKER), str(tmp_path)])
    assert codes == [0, 0], logs[1][-3000:]
    cases = [dict(re.findall(r"^CASE ([^:]+): (.*)$", log, re.MULTILINE)) for log in logs]
    differ = "Disagreement: fit's settings differ between processes: "
    for case in cases:
        assert case["batch_size"] == (
            f"{differ}batch_size is 8 on process 0, 16 on process 1. {AGREE}; otherwise they "
            "would wait for each other's steps for ever or train on batches no process "
            "asked for.")
        assert case["epochs"].startswith(
            f"{differ}epochs is 2 on process 0, 3 on process 1. {AGREE}")
        assert case["validation"].startswith(
            f"{differ}validation_data given is False on process 0, True on process 1. ")
        assert case["width"].startswith(
            f"{differ}the model's parameter count is 21 on process 0, 41 on process 1. ")
        assert case["checkpoint_dir"].startswith(
            f"{differ}checkpoint_dir differs (process 0 has one value; process 1 has another; "
            f"this process, {cases.index(case)}, has ")
        # EarlyStopping-like: process 1's callback stops after epoch 1 of 4;
        # both stop there (16 rows per process, global batch 8: 4 steps).
        assert case["stop"] == "trained 4 steps"
        assert case["evaluate"] == (
            "Disagreement: evaluate's settings differ between processes: batch_size is 8 on "
            "process 0, 16 on process 1. Every process must run the same evaluate (the same "
            "arguments, model and optimizer), each with its own share of the data; otherwise "
            "they would wait for each other's steps for ever or train on batches no process "
            "asked for.")
    assert cases[1]["no rows"] == (
        "ValueError: The training data has no rows. Pass at least one sample.")
    assert cases[0]["no rows"] == (
        "Disagreement: Process 1 failed while preparing fit, so this process (process 0) "
        "stops too instead of waiting for it: ValueError: The training data has no rows. "
        "Pass at least one sample.")
    assert cases[1]["predict"] == "ValueError: The data has no rows. Pass at least one sample."
    assert cases[0]["predict"] == (
        "Disagreement: Process 1 failed while preparing predict, so this process (process 0) "
        "stops too instead of waiting for it: ValueError: The data has no rows. Pass at "
        "least one sample.")


def _left_fit(failed, survivor):
    return (f"keras_dp: process {failed} left fit with an error while this process "
            f"(process {survivor}) was still in it: RuntimeError: a callback failed on "
            f"process {failed}\nkeras_dp: this process waits for process {failed} in the "
            f"next step and cannot go on without it, so it ends now (status 1, 2.5 s after "
            f"the error). Fix the error on process {failed}; across processes, an error that "
            f"one process alone raises in fit must end the run: catch it on every process "
            f"or on none.")


@pytest.mark.slow  # 20 s; the same message, for an error caught, runs in CI (below)
def test_an_uncaught_error_on_one_process_ends_every_process_within_the_heartbeat(tmp_path):
    # Process 1's callback raises after epoch 1. Before, process 1 waited in
    # JAX's shutdown (up to 300 s) for process 0, which waited in epoch 2's
    # first step for process 1: both hung until killed. Then process 0 ended
    # with JAX's "detected fatal errors" after the heartbeat timeout; now
    # with keras_dp's message, naming process 1 and its error.
    start = time.monotonic()
    codes, logs = run_pair(tmp_path, timeout=60, env={distributed.HEARTBEAT_ENV: "5"},
                           command=[sys.executable, str(MISMATCH_WORKER), "raise"])
    assert codes == [1, 1], logs[0][-3000:] + logs[1][-3000:]
    assert "RuntimeError: a callback failed on process 1" in logs[1]
    assert _left_fit(1, 0) in logs[0] and "fatal errors" not in logs[0]
    print(f"both ended {time.monotonic() - start:.1f} s after the start")


# Process 0 runs the coordination service, so its end is handled apart: behind --runslow.
@pytest.mark.parametrize("failed", [1, pytest.param(0, marks=pytest.mark.slow)])
def test_an_error_caught_on_one_process_only_ends_every_process_with_its_reason(
        tmp_path, failed):
    # Before, the process that caught its error went on and, at its exit,
    # waited in JAX's shutdown (300 s) for the other, which waited for it in
    # the next step for ever. An error raised and caught on every process
    # at the same point stops none: the next fit trains on both.
    start = time.monotonic()
    codes, logs = run_pair(tmp_path, timeout=90, env={distributed.HEARTBEAT_ENV: "5"},
                           command=[sys.executable, str(MISMATCH_WORKER), "caught",
                                    str(failed)])
    elapsed = time.monotonic() - start
    survivor = 1 - failed
    assert codes == [1, 1], logs[0][-3000:] + logs[1][-3000:]
    for log in logs:
        assert "CASE after an error on every process: trained 4 steps" in log, log[-3000:]
    assert f"CAUGHT a callback failed on process {failed}\ndone\n" in logs[failed]
    assert logs[failed].rstrip().endswith(
        f"keras_dp: process {failed} ends with status 1: its error left a call the other "
        "processes were in, and they have ended."), logs[failed][-3000:]
    assert _left_fit(failed, survivor) in logs[survivor]
    assert "done" not in logs[survivor] and "fatal errors" not in logs[survivor]
    assert elapsed < 80, elapsed  # not JAX's 300 s shutdown
    print(f"both ended {elapsed:.1f} s after the start")


@pytest.mark.slow  # 12 s; test_an_error_caught_on_one_process_only_ends_every_process_with_its_reason runs in CI
def test_a_read_of_the_split_state_on_process_0_alone_is_named_on_every_process(tmp_path):
    # `if is_primary(): self.model.get_weights()` mid-epoch, with the state
    # split across processes: process 0's gather met process 1's next step,
    # which aborted in gloo ("collective mismatch") and left process 0 with
    # "Connection reset by peer". Now one round comes first: the read on
    # every process trains on; on process 0 alone, both end with the reason.
    codes, logs = run_pair(tmp_path, timeout=90, env={
        distributed.HEARTBEAT_ENV: "5", "KERAS_DP_AGREEMENT_TIMEOUT": "5"},
        command=[sys.executable, str(MISMATCH_WORKER), "read_on_0"])
    assert codes == [1, 1], logs[0][-3000:] + logs[1][-3000:]
    for log in logs:
        assert "TRAINED every process 8" in log, log[-3000:]  # 2 x 64 rows, batches of 16
        assert "TRAINED process 0 alone" not in log
    # The read on every process: the same gathered weights on both; the
    # read on process 0 alone never gathered.
    reads = [[line for line in log.splitlines() if line.startswith("READ ")] for log in logs]
    assert len(reads[0]) == 1 and reads[0] == reads[1], reads
    reason = ("A callback read the model (self.model) after 3 steps of epoch 1 on process 0, "
              "and process 1 did not read it there within 5 s")
    assert reason in logs[0] and reason in logs[1], logs[0][-3000:] + logs[1][-3000:]
    assert ("the training state is split across processes and could not be gathered on "
            "this process alone, so the model holds") in logs[0]
    assert "Gloo AllGather failed" not in logs[0] + logs[1]
    assert "fatal errors" not in logs[0] + logs[1]


@pytest.mark.slow  # 7 s; an error on one process alone runs in CI (test_an_error_caught_on_one_process_only...)
def test_an_error_on_one_process_as_the_fit_opens_its_checkpoints_ends_every_process(
        tmp_path):
    # Opening the checkpoints (the lock, the write check, the restore) runs
    # inside the span whose errors stop every process: process 1 failing
    # there, and catching it, must not leave process 0 waiting for it in
    # its first collective until the heartbeat or the agreement times out.
    start = time.monotonic()
    codes, logs = run_pair(tmp_path, timeout=90, env={distributed.HEARTBEAT_ENV: "5"},
                           command=[sys.executable, str(MISMATCH_WORKER), "unwritable",
                                    str(tmp_path / "checkpoints")])
    elapsed = time.monotonic() - start
    assert codes == [1, 1], logs[0][-3000:] + logs[1][-3000:]
    reason = f"checkpoint_dir {tmp_path / 'checkpoints'} cannot be written to on process 1"
    assert f"CAUGHT {reason}\ndone\n" in logs[1], logs[1][-3000:]
    assert ("keras_dp: process 1 left fit with an error while this process (process 0) "
            f"was still in it: PermissionError: {reason}\n") in logs[0], logs[0][-3000:]
    assert "done" not in logs[0] and "fatal errors" not in logs[0]
    assert elapsed < 80, elapsed
    print(f"both ended {elapsed:.1f} s after the start")


CALLBACKS_WORKER = WORKER.parent / "process_callbacks_worker.py"


@pytest.mark.slow  # 18 s: moved out of CI to keep the default run under 10 minutes
def test_process_0_alone_writes_the_callbacks_files_and_evaluate_on_one_process_times_out(
        tmp_path):
    # Before, both processes ran ModelCheckpoint, CSVLogger, TensorBoard and
    # BackupAndRestore on the same paths (process 1's ModelCheckpoint failed
    # with "BlockingIOError: unable to lock file"; with a split state they
    # still did, see `_check_split_state_writers`), and evaluate on process 0
    # only waited for process 1 for ever.
    start = time.monotonic()
    codes, logs = run_pair(tmp_path, timeout=120, env={"KERAS_DP_AGREEMENT_TIMEOUT": "3"},
                           command=[sys.executable, str(CALLBACKS_WORKER), "files",
                                    str(tmp_path / "files")])
    elapsed = time.monotonic() - start
    assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    # 2 epochs: a ModelCheckpoint and a BackupAndRestore save on process 0 each
    assert re.findall(r"^SAVES (\d+)$", logs[0], re.MULTILINE) == ["4"]
    assert re.findall(r"^SAVES (\d+)$", logs[1], re.MULTILINE) == ["0"]
    files = tmp_path / "files"
    # (the backup is gone: the resumed fit's BackupAndRestore deleted it at its end)
    assert sorted(path.name for path in files.iterdir()) == [
        "log.csv", "tb", "w1.weights.h5", "w2.weights.h5"]
    rows = (files / "log.csv").read_text().splitlines()
    assert rows[0] == "epoch,loss,val_loss" and [row.split(",")[0] for row in rows[1:]] == [
        "0", "1"]
    for part in ("train", "validation"):
        assert len(list((files / "tb" / part).iterdir())) == 1  # one writer's event file
    assert re.findall(r"^CASE evaluate: (.*)$", logs[0], re.MULTILINE) == [
        "NotEveryProcess: evaluate on process 0 waited 3 s for every process to call "
        "evaluate too, and process 1 did not. Across processes, call evaluate on every "
        "process, each with its own share of the data, and print or save its result on "
        "process 0 only (keras_dp.distributed.is_primary()). If process 1 did call it: "
        "every process must also make the same trainers in the same order "
        "(a ShardedTrainer; each fit_sharded call makes one), since their rounds "
        "are named by that order: a trainer made on some "
        "processes only shifts the names. This process can no longer "
        "work with the others: let the error end it. (KERAS_DP_AGREEMENT_TIMEOUT sets how "
        "long a process waits.)"]
    # Every process restores the backup process 0 wrote (epochs 1-2 done), or,
    # when process 1 reads another directory, both refuse to start apart.
    cases = [dict(re.findall(r"^CASE ([^:]+): (.*)$", log, re.MULTILINE)) for log in logs]
    for case in cases:
        assert case["resumed"] == "trained epochs [2]"
        assert case["one backup"] == (
            "Disagreement: The processes resume fit at different points: epoch 3 on "
            "process 0, epoch 1 on process 1. Give every process the same checkpoint_dir "
            "(and BackupAndRestore backup_dir), on a filesystem they all see (process 0 "
            "writes it; every process reads it).")
    # A stop after batch 1 of 4 on both processes trains 2 steps on both.
    for log in logs:
        assert "CASE both: trained 2 steps" in log, log[-3000:]
        # ... and a stop of evaluate and predict after batch 1 of 4 ends both there.
        assert "CASE stopped: evaluate of 2 batches True, predicted 16 rows" in log, log[-3000:]
    _check_split_state_writers(tmp_path / "files-split", logs)
    assert "CASE evaluate" not in logs[1] and all("done" in log for log in logs)
    assert elapsed < 90, elapsed  # the evaluate waited 3 s, not 300 (35 s at load 10)
    print(f"both ended {elapsed:.1f} s after the start")


def _check_split_state_writers(split, logs):
    # With state_sharding="full" (a 64x64 kernel split over the 2 processes'
    # 4 devices) every process ran the writers before, on the same paths:
    # here each process names its own directory, and process 1's stays empty.
    # The ModelCheckpoint saves every 2 of 8 steps, a BackupAndRestore after
    # each of 2 epochs: 6 saves, all on process 0.
    assert re.findall(r"^CASE split: (.*)$", logs[0], re.MULTILINE) == ["SAVES 6"]
    assert re.findall(r"^CASE split: (.*)$", logs[1], re.MULTILINE) == ["SAVES 0"]
    assert sorted(path.name for path in split.iterdir()) == [
        "process0", "trained0.npz", "trained1.npz"]
    mine = split / "process0"
    assert sorted(path.name for path in mine.iterdir()) == ["log.csv", "tb", "w.weights.h5"]
    rows = (mine / "log.csv").read_text().splitlines()
    assert rows[0] == "epoch,loss,val_loss" and [row[0] for row in rows[1:]] == ["0", "1"]
    for part in ("train", "validation"):
        assert len(list((mine / "tb" / part).iterdir())) == 1
    # The last save, at the last step, holds the weights fit ended with, whole.
    import keras

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64), keras.layers.Dense(1)])
    model.load_weights(mine / "w.weights.h5")
    trained = [np.load(split / f"trained{index}.npz") for index in range(2)]
    assert [w.shape for w in model.get_weights()] == [(64, 64), (64,), (64, 1), (1,)]
    for index, saved in enumerate(model.get_weights()):
        np.testing.assert_array_equal(saved, trained[0][f"arr_{index}"])
        np.testing.assert_array_equal(saved, trained[1][f"arr_{index}"])


@pytest.mark.slow  # 20 s; a stop on both processes mid-epoch runs in CI (above)
def test_a_stop_mid_epoch_on_one_process_only_ends_both_with_a_message(tmp_path):
    # Before, process 1 left the epoch after batch 1 while process 0 waited
    # for it in the next step, and both hung (process 1 at the epoch's end).
    start = time.monotonic()
    codes, logs = run_pair(tmp_path, timeout=60,
                           env={"KERAS_DP_AGREEMENT_TIMEOUT": "3",
                                distributed.HEARTBEAT_ENV: "5"},
                           command=[sys.executable, str(CALLBACKS_WORKER), "stop"])
    elapsed = time.monotonic() - start
    assert codes[1] == 1, logs[1][-3000:]
    assert ("NotEveryProcess: model.stop_training was set after batch 1 of epoch 1 on "
            "process 1, and process 0 did not stop there within 3 s: it waits for this "
            "process in the next step. Across processes a callback must stop every process "
            "at the same batch") in logs[1]
    assert codes[0] == 1, logs[0][-3000:]
    assert ("keras_dp: process 1 left fit with an error while this process (process 0) "
            "was still in it: NotEveryProcess: model.stop_training was set") in logs[0]
    assert elapsed < 50, elapsed
    print(f"both ended {elapsed:.1f} s after the start")


def test_a_sigterm_to_the_launcher_reaches_every_child_and_it_waits_for_them():
    # A scheduler's preemption signal to `keras-dp launch` reached no child:
    # the launcher died and its children trained on, orphaned. Each child
    # here takes a second to "save" after the signal, longer than nothing.
    script = ("import os, signal, sys, time\n"
              "def stop(signum, frame):\n"
              "    time.sleep(1)\n"
              "    print('saved', flush=True)\n"
              "    sys.exit(143)\n"
              "signal.signal(signal.SIGTERM, stop)\n"
              "print('ready', flush=True)\n"
              "time.sleep(120)\n")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "keras_dp", "launch", "--processes", "2", "--",
         sys.executable, "-c", script],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        ready = 0
        for line in launcher.stdout:
            ready += line.endswith("] ready\n")
            if ready == 2:
                break
        launcher.send_signal(signal.SIGTERM)
        output, _ = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 143
    assert "[process 0] saved" in output and "[process 1] saved" in output


def test_processes_restored_at_different_points_refuse_to_start_apart():
    # Only a BackupAndRestore's start was compared: a checkpoint that one
    # process read and another did not (another directory, a failed read)
    # started them at different steps, mixing batches or waiting forever.
    from keras_dp.multihost import agreement

    class Placement:  # the round's result: every process's (epoch, steps)
        def __init__(self, starts):
            channel = type("Channel", (), {"all_gather": lambda self, values: starts})()
            self.exchange = type("Exchange", (), {"channel": lambda self, timeout: channel})()

    agreement.same_start(Placement([[1, 5], [1, 5]]), 1, 5)
    with pytest.raises(agreement.Disagreement, match=(
            r"^The processes resume fit at different points: epoch 2 after 5 steps on "
            r"process 0, epoch 1 on process 1\. Give every process the same checkpoint_dir")):
        agreement.same_start(Placement([[1, 5], [0, 0]]), 1, 5)
