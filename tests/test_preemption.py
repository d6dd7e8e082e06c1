"""Preempted anywhere, resumed anywhere: mid-epoch checkpoints on another topology, lost peers, the soak.

The multi-process runs start `scripts/soak.py job` (a small id regression,
shuffled, with a histogram of the rows each epoch trained) as P processes of
D simulated CPU devices joined over loopback, like tests/test_distributed.py,
under hard time limits that kill every process they started.
"""

import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from keras_dp import liveness
from keras_dp.checkpoint import plan as plan_lib
from keras_dp.core.live import Position
from keras_dp.sources.arrays import ArrayBatches

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOAK = ROOT / "scripts" / "soak.py"
sys.path.insert(0, str(SOAK.parent))
import soak  # noqa: E402

ROWS, BATCH = 470, 48  # the job's: 10 steps an epoch, the last of 38 rows
GRAIN_ROWS = 480  # an ElasticIterator drops a partial last batch: 10 full ones


# -- Each process's part of the global order -------------------------------------


def test_the_parts_of_every_global_batch_are_the_batch_one_process_takes():
    x, y = np.arange(100.0)[:, None], np.arange(100.0)
    whole = ArrayBatches(x, y, None, batch_size=24, shuffle=True, seed=3, class_weight=None)
    for shuffle in (True, "batch"):
        whole = ArrayBatches(x, y, None, batch_size=24, shuffle=shuffle, seed=3,
                             class_weight=None)
        expected = [batch[1] for batch in whole.epoch(2)]  # 4 of 24 rows, then 4
        for count in (2, 3, 4):
            parts = []
            for index in range(count):
                part = ArrayBatches(x, y, None, batch_size=24 // count, shuffle=shuffle, seed=3,
                                    class_weight=None)
                part.read_part(index, count)
                parts.append((part.planned_rows(), iter(part.epoch(2))))
                assert part.steps == 5 and part.batch_size == 24
            for step, batch in enumerate(expected):
                rows = [next(batches)[1] for planned, batches in parts if planned[step]]
                np.testing.assert_array_equal(np.concatenate(rows), batch)
            # The last batch's 4 rows are all process 0's; the others have none.
            assert [planned[-1] for planned, _ in parts] == [4] + [0] * (count - 1)


# -- What a mid-epoch checkpoint resumes on --------------------------------------


def _tree(processes, order=None, steps=5, rows=470):
    topology = {"processes": processes, "devices": 4, "local_batch": 24}
    if order is not None:
        topology["order"] = order
    return {"topology": topology, "plan": {"rows": rows}}, Position(1, steps)


def _topology(processes, order):
    return {"processes": processes, "devices": processes * 2, "local_batch": 24,
            "order": order}


@pytest.mark.parametrize("saved,now", [(2, 1), (2, 4), (1, 3), (4, 2)])
def test_a_global_order_resumes_inside_an_epoch_on_any_number_of_processes(saved, now):
    for order in (1, 2):  # whole arrays, a Grain ElasticIterator
        tree, position = _tree(saved, order)
        plan_lib.check_topology(tree, position, _topology(now, order), "ckpt", lambda: "")


def test_shares_and_orders_that_differ_are_refused_inside_an_epoch_only():
    tree, position = _tree(2, 0)  # each process its share, in its own order
    with pytest.raises(ValueError, match=r"written by 2 processes .* this fit runs on 1 "
                                         r"process .* pass the same whole arrays on every "
                                         r"process .* grain.experimental.ElasticIterator"):
        plan_lib.check_topology(tree, position, _topology(1, 1), "ckpt", lambda: "")
    plan_lib.check_topology(tree, position, _topology(2, 0), "ckpt", lambda: "")  # same count
    tree, position = _tree(2, 1)  # whole arrays, and now shares on as many processes
    with pytest.raises(ValueError, match=r"its training rows were the same whole arrays on "
                                         r"every process, in one global order, where this "
                                         r"fit's are each process's share"):
        plan_lib.check_topology(tree, position, _topology(2, 0), "ckpt", lambda: "")
    tree, _ = _tree(2, 0)
    plan_lib.check_topology(tree, Position(2, 0), _topology(1, 1), "ckpt", lambda: "")


def test_a_checkpoint_from_before_orders_is_global_for_one_processs_arrays_only():
    tree, position = _tree(1)  # one process, arrays (its plan has rows)
    plan_lib.check_topology(tree, position, _topology(2, 1), "ckpt", lambda: "")
    tree, position = _tree(1, rows=-1)  # one process, a dataset
    with pytest.raises(ValueError, match="written by 1 process"):
        plan_lib.check_topology(tree, position, _topology(2, 2), "ckpt", lambda: "")


# -- A lost peer's line ----------------------------------------------------------


def test_the_lost_line_names_the_process_the_checkpoint_and_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv(liveness.RESUME_COMMAND_ENV, "sbatch --requeue train.sh")
    monkeypatch.setattr(liveness, "_checkpoint", {})
    assert liveness.lost_message([1], 0, 20) == (
        "keras_dp: process 1 stopped answering (JAX's coordination service heard no "
        "heartbeat for 20 s), so this process (process 0) ends now, with status 75. No "
        "checkpoint was saved (pass checkpoint_dir to fit to resume from the last one). To "
        "resume, run the same command again, on this number of processes or another: "
        "sbatch --requeue train.sh")
    for name in ("3", "4", "5.orbax-checkpoint-tmp-17", ".keras_dp.lock"):
        (tmp_path / name).mkdir()
    liveness.note_checkpoint(tmp_path, 4, "after 6 steps of epoch 2")
    assert (f"The newest complete checkpoint, {tmp_path / '4'} (after 6 steps of epoch 2), "
            "is intact; a save cut short leaves only a temporary directory, never read. To "
            "resume") in liveness.lost_message([2, 3], 1, 5)
    assert liveness.lost_message([2, 3], 1, 5).startswith("keras_dp: processes 2, 3 stopped")
    (tmp_path / "6").mkdir()  # committed by process 0 as this one was told nothing yet
    assert f"checkpoint, {tmp_path / '6'}, is intact" in liveness.lost_message(None, 1, 5)
    assert liveness.lost_message(None, 1, 5).startswith(
        "keras_dp: JAX's coordination service stopped answering, so this process")


# -- Across processes --------------------------------------------------------------


def run_job(processes, devices, out, *args, limit=240):
    """`soak.py job` as `processes` processes of `devices` devices; their statuses and logs."""
    run = soak.Run(processes, str(out), None, 5, job_args=args, devices=devices)
    if not run.wait(limit):
        pytest.fail(f"{processes} x {devices} did not finish within {limit} s: "
                    + run.text(0)[-3000:])
    return [status for _, status in run.ended], [run.text(i) for i in range(processes)]


def results(out):
    result = np.load(out / "process0.npz")
    return [result[name] for name in result.files if name.startswith("arr_")], result


def stopped_mid_epoch(tmp_path, source, rows):
    """A 2 x 2 run in float64 stopped by SIGTERM inside epoch 2: its checkpoint directory."""
    checkpoints = tmp_path / "2x2"
    statuses, logs = run_job(2, 2, tmp_path / "stopped", "--x64", "--source", source,
                             "--rows", str(rows), "--epochs", "3", "--checkpoint-dir",
                             str(checkpoints), "--sigterm-after", "1:3")
    assert statuses == [143, 143], logs[1][-3000:]
    stops = set(re.findall(r"saved a checkpoint in .* after (\d+) steps of epoch 2\.",
                           "\n".join(logs)))
    assert len(stops) == 1 and 3 <= int(stops.pop()) < 10, logs[0][-3000:]
    return checkpoints


def resumes_exactly(tmp_path, checkpoints, source, rows, processes, devices):
    """Resume a copy of `checkpoints` on `processes` x `devices`, and run unbroken there: compare."""
    import shutil

    name = f"{processes}x{devices}"
    copy = tmp_path / f"from-2x2-on-{name}"
    shutil.copytree(checkpoints, copy)
    common = ("--x64", "--source", source, "--rows", str(rows), "--epochs", "3")
    statuses, logs = run_job(processes, devices, tmp_path / name, *common,
                             "--checkpoint-dir", str(copy))
    assert set(statuses) == {0}, logs[0][-3000:]
    assert "PHASE resumed-step 1 " in logs[0]  # inside epoch 2
    statuses, logs = run_job(processes, devices, tmp_path / f"unbroken-{name}", *common)
    assert set(statuses) == {0}, logs[0][-3000:]
    resumed, result = results(tmp_path / name)
    unbroken, _ = results(tmp_path / f"unbroken-{name}")
    assert result["epochs"].tolist() == [1, 2]
    np.testing.assert_array_equal(result["ids"], np.ones(rows))  # every row once, last epoch
    for mine, theirs in zip(resumed, unbroken, strict=True):
        scale = max(float(np.abs(theirs).max()), 1e-6)
        assert float(np.abs(mine - theirs).max()) <= 1e-12 * scale, name
    return resumed, unbroken


@pytest.mark.slow  # 2 stops of 2 x 2 and 16 runs on 4 topologies: about 5 minutes
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("source,rows", [("arrays", ROWS), ("grain", GRAIN_ROWS)])
def test_mid_epoch_checkpoints_of_2x2_resume_on_every_topology_as_unbroken_runs(
        tmp_path, source, rows):
    pytest.importorskip("grain")
    checkpoints = stopped_mid_epoch(tmp_path, source, rows)
    for processes, devices in ((1, 4), (4, 1), (1, 2), (2, 1)):
        resumes_exactly(tmp_path, checkpoints, source, rows, processes, devices)


# -- The soak ------------------------------------------------------------------------


def soak_output(*args, limit):
    process = subprocess.run([sys.executable, str(SOAK), *args], capture_output=True,
                             text=True, timeout=limit, cwd=ROOT)
    return process.returncode, process.stdout + process.stderr


def check_soak(code, output, faults):
    assert code == 0, output[-5000:]
    assert re.search(rf"soak: {faults} faults injected, {faults} survived", output), output
    lines = re.findall(r"^fault \d+: .*$", output, re.MULTILINE)
    assert len(lines) == faults and all(": survived" in line for line in lines), output
    return lines


def test_three_fixed_faults_each_end_every_process_clearly_and_the_job_finishes_exactly(
        tmp_path):
    # A SIGTERM inside an epoch on 2 processes, requeued on 1 (the rest of
    # the epoch on another topology, from whole arrays); there a second
    # SIGTERM during the save the first asked for; then on 2 processes a
    # SIGKILL of process 0 in a save (the coordination service outlives it:
    # process 1 ends with the line naming it, and the save cut short is never
    # read). The job ends with the unbroken run's weights (float32, to
    # rounding: one run had 2 devices, the others 4), every row once.
    code, output = soak_output(
        "--plan", "SIGTERM:1:step:1,SIGTERM2:0:resumed-step:2,SIGKILL:0:save:2",
        "--workdir", str(tmp_path), limit=280)
    lines = check_soak(code, output, 3)
    assert "SIGTERM to process 1 of 2 in step" in lines[0]
    assert "requeued on 1 process, first step" in lines[0]
    assert "again to process 0 in the save" in lines[1]
    assert "SIGKILL to process 0 of 2 in save" in lines[2]
    assert "job finished after 4 runs: weights equal the unbroken run's within 1e-5" in output


@pytest.mark.slow  # about 10 minutes on the 2-core VM
@pytest.mark.timeout(2400)
def test_a_soak_of_twenty_random_faults_is_survived():
    code, output = soak_output("--faults", "20", "--seed", "1", limit=2300)
    lines = check_soak(code, output, 20)
    assert any("requeued on 3 processes" in line for line in lines)
    assert any("requeued on 1 process," in line for line in lines)
