"""The benchmark script runs (a smoke run; real numbers are in BENCHMARKS.md)."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_bench_quick_times_every_system(tmp_path):
    out = tmp_path / "results.json"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench.py"), "--devices", "2", "--quick",
         "--out", str(out)],
        check=True, timeout=240, cwd=ROOT, capture_output=True,
    )
    report = json.loads(out.read_text())
    systems = {(row["system"], row["k"]) for row in report["rows"]}
    assert systems == {("keras_dp", 1), ("keras_dp", 2), ("keras DataParallel", 1),
                       ("keras DataParallel", 2), ("guide jit loop", 1), ("compute bound", 1)}
    assert all(row["median"] > 0 for row in report["rows"])
    assert report["machine"]["devices"] == 2
