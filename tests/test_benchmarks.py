"""The benchmark script runs (a smoke run; real numbers are in BENCHMARKS.md)."""

import json
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import devices
from conftest import sgd_mlp

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
                       ("keras DataParallel", 2), ("guide jit loop", 1), ("compute bound", 1),
                       ("keras merged scan (emulated)", 1), ("keras merged scan (emulated)", 2)}
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


def test_emulated_keras_scan_trains_as_keras_fit_does(mnist):
    """K-step scans, then a last group of fewer than K batches as single steps,
    on 2 devices: the weights Keras's own single-device `fit` reaches."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import keras_scan

    (x, y), _ = mnist
    x, y = x[:5 * 32], y[:5 * 32]  # 5 batches: 2 scans of K=2, then 1 single step
    system = keras_scan.KerasScan(32, 2, devices(2), seed=None, model=sgd_mlp())
    system.prepare(x, y)
    system.run(x, y)
    reference = sgd_mlp()
    initial = [np.asarray(weight) for weight in reference.trainable_weights]
    reference.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    assert int(system.state[2][0]) == 5  # the optimizer's iteration count: every batch ran
    assert min(np.abs(after - before).max() for after, before in
               zip(keras_scan.weights(system), initial)) > 1e-3  # every variable trained
    for ours, keras_weight in zip(keras_scan.weights(system), reference.trainable_weights,
                                  strict=True):
        keras_weight = np.asarray(keras_weight)
        scale = np.abs(keras_weight).max()
        np.testing.assert_allclose(ours, keras_weight, rtol=0, atol=1e-5 * scale)


def test_targets_takes_each_ratio_within_a_run_then_the_median():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import targets

    def run(ours, host, scan_k1, scan_k4):
        return {"rows": [
            {"system": "keras_dp", "batch": 64, "k": 1, "median": ours / 2},
            {"system": "keras_dp", "batch": 64, "k": 4, "median": ours},
            {"system": "keras_dp host-fed", "batch": 64, "k": 1, "median": host},
            {"system": targets.SCAN, "batch": 64, "k": 1, "median": scan_k1},
            {"system": targets.SCAN, "batch": 64, "k": 4, "median": scan_k4},
        ]}

    reports = [run(1000, 800, 900, 100), run(500, 500, 400, 50), run(3000, 2000, 2000, 600)]
    found = targets.ratios(reports)
    assert found[("keras_dp best / host-fed best", 64)] == [1.25, 1.0, 1.5]
    assert found[("keras_dp best / Keras merged scan best", 64)] == [1000 / 900, 1.25, 1.5]
    assert found[("keras_dp best / Keras merged scan best K>1", 64)] == [10.0, 10.0, 5.0]
    table = targets.verdict_table(reports)
    assert "| keras_dp best / host-fed best | 64 | 1.25 | 1.00-1.50 | 3 | 1.00 | yes |" in table
    assert "| keras_dp best / Keras merged scan best | 64 | 1.25 | 1.11-1.50 | 3 | 1.20 | yes |" \
        in table
    assert ("keras_dp best / compute bound", 64) not in found  # no bound rows, no ratio


@pytest.mark.slow
def test_evaluate_steps_times_every_k_and_every_k_gives_the_same_numbers(tmp_path):
    out = tmp_path / "evaluate.json"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "evaluate_steps.py"), "--devices", "2",
         "--samples", "300", "--batch-sizes", "64", "--ks", "1,4", "--reps", "2",
         "--out", str(out)],
        check=True, timeout=240, cwd=ROOT, capture_output=True,
    )
    rows = json.loads(out.read_text())["rows"]
    assert {(row["system"], row["k"]) for row in rows} == {
        ("keras_dp evaluate", 1), ("keras_dp evaluate", 4),
        ("keras_dp predict", 1), ("keras_dp predict", 4)}
    assert all(row["median"] > 0 for row in rows)
    by_k = {(row["system"], row["k"]): row["loss"] for row in rows}
    # 300 rows: 4 full batches and one of 44, so K=4 runs one 4-step call
    # and a single step; the loss of an untrained 10-class model is near ln 10.
    assert by_k[("keras_dp evaluate", 4)] == by_k[("keras_dp evaluate", 1)]
    assert abs(by_k[("keras_dp evaluate", 1)] - np.log(10)) < 0.1
    assert by_k[("keras_dp predict", 4)] == by_k[("keras_dp predict", 1)]


def test_gpu_plan_runs_the_benchmarks_with_arguments_they_accept():
    """benchmarks/gpu.sh is only run on a lent GPU: check here that each of
    its commands names a script that exists and arguments that script parses."""
    import shlex

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench
    import evaluate_steps
    import model_axis
    import resnet

    parsers = {"bench.py": bench.parse_args, "evaluate_steps.py": evaluate_steps.parse_args,
               "resnet.py": resnet.parse_args, "model_axis.py": model_axis.parse_args}
    text = (ROOT / "benchmarks" / "gpu.sh").read_text().replace("\\\n", " ")
    commands = re.findall(r"python3 benchmarks/(\S+\.py)([^|\n]*)", text)
    assert sorted({script for script, _ in commands}) == sorted(parsers)
    assert len(commands) == 5
    for script, arguments in commands:
        arguments = shlex.split(arguments.split("2>&1")[0].replace('"$out/', '"/tmp/'))
        args = parsers[script](arguments)
        assert args.platform == "gpu", script


def test_model_axis_parses_meshes_and_counts_model_flops_as_palm_does():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import model_axis

    args = model_axis.parse_args(["--platform", "gpu", "--config", "1b", "--meshes", "1xN,Nx1"])
    assert args.meshes == ["1xN", "Nx1"] and args.policy == "mixed_bfloat16"
    assert model_axis.parse_args([]).policy == "float32"
    assert model_axis.mesh_shape("1xN", 8) == (1, 8) and model_axis.mesh_shape("2x2", 4) == (2, 2)
    with pytest.raises(SystemExit):
        model_axis.mesh_shape("2x2", 8)
    with pytest.raises(SystemExit):
        model_axis.parse_args(["--meshes", "2by2"])
    # Gemma-shaped 1b: 6 x 1.06e9 parameters, and the attention's
    # 12 x 8 layers x 8 heads x 256 x 1,024 per token.
    config = model_axis.CONFIGS["1b"]
    assert model_axis.model_flops_per_token(config, 1_000, 1024) == 6_000 + 12 * 8 * 8 * 256 * 1024
    rows = [{"system": "keras_dp", "mesh": "2x2", "step_s_by_round": [2.0, 4.0, 3.0]},
            {"system": "keras", "mesh": "2x2", "step_s_by_round": [1.0, 4.0, 2.0]},
            {"system": "keras_dp", "mesh": "4x1", "step_s_by_round": [1.0, 2.0, 1.5]}]
    assert model_axis.ratios(rows) == {"keras_dp 4x1 / keras_dp 2x2": 0.5,
                                       "keras_dp 2x2 / keras 2x2": 1.5}


def run_script(name, *arguments):
    """Run `benchmarks/<name>` as its own process; return what it printed."""
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / name), *arguments],
                          check=True, timeout=240, cwd=ROOT, capture_output=True,
                          text=True).stdout


def test_checkpoint_size_and_cli_startup_parse_their_arguments():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import checkpoint_size
    import cli_startup

    defaults = checkpoint_size.parse_args([])  # README's run: 10 epochs, 2 kept, 1 device
    assert (defaults.epochs, defaults.keep, defaults.devices, defaults.rows) == (10, 2, 1, 256)
    assert checkpoint_size.parse_args(["--keep", "1", "--epochs", "3"]).keep == 1
    assert cli_startup.parse_args([]).runs == 5 and cli_startup.parse_args(["--runs", "2"]).runs == 2


@pytest.mark.slow  # a fresh JAX process and 3 epochs with checkpoints: about 15 s
def test_checkpoint_size_prints_the_state_and_the_directorys_bytes():
    output = run_script("checkpoint_size.py", "--epochs", "3", "--keep", "1", "--rows", "64",
                        "--batch-size", "32")
    # The MLP's float32 weights and Adam's two slots (3 x 25,450 x 4 bytes),
    # Adam's step count and rate, and the metrics' totals: exact.
    assert "model: 25,450 parameters; training state 305,424 bytes (305 KB" in output
    size = re.search(r"after 3 epochs \(checkpoints_to_keep=1\): checkpoints 2; "
                     r"directory ([\d,]+) bytes \((\d+) KB, du -sb\)", output)
    assert size, output
    nbytes = int(size[1].replace(",", ""))
    assert 100_000 < nbytes < 2_000_000 and round(nbytes / 1000) == int(size[2])
    assert re.search(r"machine: .+, \d+ cores, 1 simulated device\(s\); keras 3\.", output)


@pytest.mark.slow  # a fresh process importing Keras and JAX: 4 to 6 s
def test_cli_startup_times_help_with_and_without_importing_keras_first():
    output = run_script("cli_startup.py", "--runs", "1")
    help_s = re.search(r"python -m keras_dp --help: median (\d+\.\d\d) s "
                       r"\(range [\d.]+-[\d.]+ s, 1 runs\)", output)
    imports_s = re.search(r"the same after import jax, keras: median (\d+\.\d\d) s", output)
    assert help_s and imports_s, output
    assert 0 < float(help_s[1]) < float(imports_s[1])  # --help imports neither
    assert re.search(r"ratio: \d+\.\dx\nmachine: .+, \d+ cores, Python 3\.", output)


def test_install_size_counts_the_installed_closure_of_keras_dp_and_its_extras():
    sys.path.insert(0, str(ROOT / "scripts"))
    import install_size

    core = install_size.closure("keras_dp")
    with_tf = install_size.closure("keras_dp", ["tf"])
    assert {"keras", "jax", "jaxlib", "numpy", "orbax-checkpoint"} <= set(core)
    assert "tensorflow-cpu" not in core and "tensorflow-cpu" in with_tf
    assert set(core) < set(with_tf)
    output = subprocess.run([sys.executable, str(ROOT / "scripts" / "install_size.py"), "tf",
                             "--top", "1"], check=True, timeout=60, capture_output=True,
                            text=True).stdout
    found = re.search(r"^keras_dp\[tf\]: (\d+) packages \(keras_dp included\), "
                      r"([\d,]+) MB installed\n  tensorflow-cpu [\d.]+: ([\d,]+) MB\n"
                      r"machine: .+, \d+ cores, \w+, Python 3\.", output)
    assert found, output
    assert int(found[1]) == len(with_tf)
    assert int(found[3].replace(",", "")) > 500  # TensorFlow is the largest: about 1.3 GB


def test_fresh_clone_takes_both_set_up_commands_from_readme_and_splits_install_from_job():
    script = ROOT / "scripts" / "fresh_clone.sh"
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
    # The script's own extraction, run on README, gives README's two commands.
    text = script.read_text()
    commands = {}
    for name in ("main_command", "test_command"):
        awk = re.search(name + r"=\$\(awk '([^']+)'", text).group(1)
        commands[name] = subprocess.run(["awk", awk, str(ROOT / "README.md")], check=True,
                                        capture_output=True, text=True).stdout.strip()
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme)
    assert commands["main_command"] == blocks[0]
    assert commands["main_command"].endswith(' && pip install -e ".[plot]" && keras-dp train')
    assert commands["test_command"] == blocks[1]
    assert commands["test_command"].endswith(' && pip install -e ".[test]" && python -m pytest -n 2 --dist loadfile')
    # Its split at the last "&&" (bash's ${command% && *} and ${command##* && }).
    split = subprocess.run(
        ["bash", "-c", 'c=$1; echo "${c% && *}"; echo "${c##* && }"', "_",
         commands["main_command"]], check=True, capture_output=True, text=True).stdout.splitlines()
    assert split == ['python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[plot]"',
                     "keras-dp train"]
