"""The benchmark script runs (a smoke run; real numbers are in BENCHMARKS.md)."""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
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


@pytest.mark.slow
def test_resnet18_model_flops_match_a_count_by_hand():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import resnet

    import keras_dp

    # By hand, forward multiply-adds x 2 per 28x28 image: stem 0.9M; stage 1
    # four 64->64 3x3 convs at 28x28, 57.8M each; stages 2-4 a strided conv,
    # three full convs and a 1x1 shortcut at 14x14, 7x7 and 4x4; dense 10k.
    by_hand = 2 * (28 * 28 * 64 * 9 + 4 * 28 * 28 * 64 * 64 * 9
                   + 14 * 14 * 128 * (64 * 9 + 3 * 128 * 9 + 64)
                   + 7 * 7 * 256 * (128 * 9 + 3 * 256 * 9 + 128)
                   + 4 * 4 * 512 * (256 * 9 + 3 * 512 * 9 + 256) + 512 * 10)
    assert resnet.forward_flops(keras_dp.models.resnet18()) == by_hand == 911_601_664


def test_bench_names_its_results_by_platform_and_device_count():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench

    assert bench.parse_args([]).devices == 1
    gpu = bench.parse_args(["--platform", "gpu", "--systems", "keras_dp,unrolled"])
    assert gpu.devices is None and gpu.out is None  # named once JAX counts the GPUs
    gpu.devices = 1
    assert bench.default_out(gpu).endswith("results-gpu-1dev.json")
    assert gpu.systems == ["keras_dp", "unrolled"]
    assert bench.parse_args(["--devices", "2"]).out.endswith("results-2dev.json")
