"""README.md: its set-up commands, and every Python block, run as written.

Each Python block runs in a fresh interpreter with `KERAS_BACKEND` unset, as
on a new machine, in a directory of its own. A block that uses names only
the blocks before it define (`x_train`, `model`) runs after them in the same
interpreter, as a reader pasting them in order would. The data is small:
`KERAS_DP_DATA_DIR` (read by `keras_dp.datasets.load_mnist`) points at an
`mnist.npz` of 512 training and 256 test images cut from the bundled subset,
as the notebooks run on `KERAS_DP_NOTEBOOK_SAMPLES`.
"""

import ast
import builtins
import configparser
import os
import pathlib
import re
import subprocess
import sys

import keras
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_opens_with_the_two_set_up_commands():
    blocks = re.findall(r"```bash\n(.*?)\n```", README, flags=re.S)
    main_job, tests = blocks[0], blocks[1]
    assert "pip install" in main_job and "keras-dp train" in main_job
    assert "pip install" in tests and "pytest" in tests
    marker = README.index("<!-- test-command -->")
    assert README[marker:].split("```bash\n", 1)[1].startswith(tests)


def test_the_set_up_commands_install_what_they_need():
    blocks = re.findall(r"```bash\n(.*?)\n```", README, flags=re.S)
    extras = configparser.ConfigParser()
    extras.read(ROOT / "setup.cfg")
    extras = extras["options.extras_require"]
    core = configparser.ConfigParser()
    core.read(ROOT / "setup.cfg")
    assert "tensorflow" not in core["options"]["install_requires"]
    assert "matplotlib" not in core["options"]["install_requires"]
    main_job, tests = (set(re.search(r'pip install -e "\.\[([\w,]+)\]"', block).group(1).split(","))
                       for block in blocks[:2])
    # The main job draws its curves; the tests read tf.data and run the notebooks.
    assert main_job == {"plot"} and "matplotlib" in extras["plot"]
    assert tests == {"test"}
    for needed in ("tensorflow-cpu", "grain", "matplotlib", "pytest", "nbclient"):
        assert needed in extras["test"]


def free_names(source):
    """Names a block reads but neither defines nor imports (nor are builtins)."""
    tree = ast.parse(source)
    defined, read = set(dir(builtins)), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else defined).add(node.id)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return read - defined


def sessions():
    """The README's Python blocks grouped into interpreter sessions, with line numbers."""
    groups = []
    for match in re.finditer(r"```python\n(.*?)```", README, flags=re.S):
        line = README[:match.start()].count("\n") + 1
        if free_names(match.group(1)) and groups:
            groups[-1][1].append(match.group(1))
        else:
            groups.append((line, [match.group(1)]))
    return groups


SESSIONS = sessions()


def test_the_blocks_group_into_sessions():
    # The quickstart and the blocks that build on it, then three standalone ones.
    assert [len(blocks) for _, blocks in SESSIONS] == [5, 1, 1, 1]


@pytest.fixture
def small_mnist(tmp_path):
    from keras_dp import datasets

    (x, y), (x_test, y_test) = datasets.load_mnist(datasets.BUNDLED_MNIST)
    data = tmp_path / "data"
    data.mkdir()
    np.savez(data / "mnist.npz", x_train=x[:512], y_train=y[:512],
             x_test=x_test[:256], y_test=y_test[:256])
    return data


def run_session(blocks, directory, data_dir):
    env = {key: value for key, value in os.environ.items() if key != "KERAS_BACKEND"}
    env.update(KERAS_DP_DATA_DIR=str(data_dir), KERAS_HOME=str(directory / "keras_home"),
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    script = directory / "session.py"
    script.write_text("\n".join(blocks))
    command = [sys.executable, str(script)]
    if "distributed.initialize()" in script.read_text():  # one process per host: try it on 2
        command = [sys.executable, "-m", "keras_dp", "launch", "--processes", "2",
                   "--cpu-devices", "1", "--", *command]
    return subprocess.run(command, cwd=directory, env=env, capture_output=True, text=True,
                          timeout=280)


def _marks(blocks):
    # The many-hosts block runs as 2 launched processes (about 30 s on a
    # 2-core machine, idle); tests/test_distributed.py launches `keras-dp
    # train` the same way in every run, so this one waits for --runslow.
    return [pytest.mark.slow] if "distributed.initialize()" in "".join(blocks) else []


@pytest.mark.parametrize("line, blocks", [
    pytest.param(line, blocks, marks=_marks(blocks), id=f"line{line}") for line, blocks in SESSIONS
])
def test_readme_python_blocks_run_as_written(line, blocks, tmp_path, small_mnist):
    work = tmp_path / "work"
    work.mkdir()
    result = run_session(blocks, work, small_mnist)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    text = "\n".join(blocks)
    if 'model.save("convnet.keras")' in text:
        model = keras.saving.load_model(work / "convnet.keras")
        assert model.count_params() == 49_378
        assert "Epoch 2/2" in result.stdout
    if ".as_text()" in text:
        assert "all-reduce" in result.stdout  # 2 devices: the gradients are summed
    if "memory_plan" in text:
        assert re.search(r"Memory per device \(2 devices, state_sharding='full'\)", result.stdout)
