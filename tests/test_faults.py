"""Faults during `fit`, made real: SIGINT at random moments, a step that fails at run time."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

SCRIPTS = pathlib.Path(__file__).parent / "scripts"
ROOT = pathlib.Path(__file__).resolve().parents[1]


def sigint_trials(*args):
    """Run `scripts/sigint_trials.py`; return its trial lines and its summary."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)  # the script sets its own device count
    done = subprocess.run([sys.executable, str(SCRIPTS / "sigint_trials.py"), *args],
                          capture_output=True, text=True, timeout=280, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return lines[:-1], lines[-1]


def check_trials(trials, summary, count):
    assert summary["trials"] == count and summary["bad"] == [], trials
    interrupted = [trial for trial in trials if trial["interrupted"]]
    assert len(interrupted) >= count // 2  # the signal came during fit, mostly
    for trial in interrupted:
        # Bitwise the state after the model's own step count, which is at
        # least every step a callback saw end, and what the note says.
        assert trial["equal"] and trial["steps"] >= trial["ended"]
        assert trial["noted"] in (None, trial["steps"])


def test_sigint_at_random_moments_never_loses_a_completed_step():
    # Before the fix about 1 in 3 such interrupts put the model back at the
    # last epoch end (5 of 12 trials, measured).
    trials, summary = sigint_trials("--trials", "6")
    check_trials(trials, summary, 6)


@pytest.mark.slow
@pytest.mark.parametrize("options", [
    ["--trials", "60"],
    ["--trials", "40", "--host"],
    ["--trials", "40", "--steps-per-execution", "3", "--seed", "1"],
    ["--trials", "40", "--steps-per-execution", "3", "--host", "--seed", "2"],
], ids=["resident", "host", "resident-k3", "host-k3"])
def test_sigint_soak(options):
    trials, summary = sigint_trials(*options)
    check_trials(trials, summary, int(options[1]))
