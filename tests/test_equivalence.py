"""Data parallelism is exact: 4 devices equal 1 device, step for step.

Run in float64 in a subprocess (float64 must be switched on before JAX
starts), so that what is compared is the algorithm, not float32 rounding.
"""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from conftest import NO_GRADIENT

SCRIPT = pathlib.Path(__file__).parent / "scripts" / "equivalence.py"


@pytest.mark.slow  # test_exact's one-epoch float64 check (1e-12) runs in every suite
def test_four_devices_equal_one_device_for_20_steps_in_float64():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--float64", "--steps", "20", "--devices", "4"],
        capture_output=True, text=True, timeout=240, env=dict(os.environ),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    runs = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [run["optimizer"] for run in runs] == ["adam", "sgd"]
    for run in runs:
        assert run["dtype"] == "float64"
        np.testing.assert_allclose(run["losses_n"], run["losses_1"], rtol=1e-5)
        assert run["losses_1"][-1] < run["losses_1"][0]
        for path, difference in run["relative_difference"].items():
            if path == NO_GRADIENT:
                continue
            assert difference <= 1e-5, (run["optimizer"], path, difference)
