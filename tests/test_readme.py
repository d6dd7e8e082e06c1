"""README.md and the documentation pages: every code block runs as written.

README.md opens with the two set-up commands (CI runs the second, the one
after the `<!-- test-command -->` marker; `tests/test_cli.py` runs the job of
the first). Every other code block of README.md and of the Markdown pages
under docs/ is one of:

- ```python: run in a fresh interpreter with `KERAS_BACKEND` unset, as on a
  new machine, in a directory of its own. A block that uses names only the
  blocks before it on the same page define (`x_train`, `model`) runs after
  them in the same interpreter, as a reader pasting them in order would.
- ```bash: run by bash in a directory of its own, this environment's
  commands (`keras-dp`, `python`) first on PATH.
- ```text: what a program prints, not a command.
- ```{directive}: a Sphinx directive (a toctree, an include).
- anything else (```console, ```yaml): not run, and each such block must
  follow a `<!-- not run: why -->` comment: commands that need a cluster, an
  accelerator, the package index, or minutes of benchmarking. The set is
  kept small (`MAX_NOT_RUN`).

The data is small: `KERAS_DP_DATA_DIR` (read by
`keras_dp.datasets.load_mnist`) points at an `mnist.npz` of 512 training and
256 test images cut from the bundled subset, as the notebooks run on
`KERAS_DP_NOTEBOOK_SAMPLES`. Blocks that launch several processes or run
`keras-dp train` end to end wait for --runslow.
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
# Pages the build leaves out (docs/conf.py's exclude_patterns) hold no code.
PAGES = [ROOT / "README.md"] + sorted(
    path for path in (ROOT / "docs").rglob("*.md")
    if "_build" not in path.parts and not path.name.startswith("_"))
# Blocks marked not run, on every page together: install commands for
# accelerators and the docs, a cluster's commands, the benchmarks' and the
# suite's own commands. More means a page shows commands no test runs.
MAX_NOT_RUN = 25

FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```[ \t]*$", flags=re.M | re.S)
NOT_RUN = re.compile(r"<!-- not run[^>]*:\s*\S[^>]*-->\s*$")


def rel(path):
    return path.relative_to(ROOT).as_posix()


def blocks(path):
    """`(language, code, line, the text before it)` of each fenced block."""
    text = path.read_text()
    return [(match.group(1).strip(), match.group(2), text[:match.start()].count("\n") + 1,
             text[:match.start()])
            for match in FENCE.finditer(text)]


def setup_blocks():
    return re.findall(r"```bash\n(.*?)\n```", README, flags=re.S)[:2]


# --- README: the front page ----------------------------------------------------


def test_readme_opens_with_the_two_set_up_commands():
    main_job, tests = setup_blocks()
    assert "pip install" in main_job and "keras-dp train" in main_job
    assert "pip install" in tests and "pytest" in tests
    marker = README.index("<!-- test-command -->")
    assert README[marker:].split("```bash\n", 1)[1].startswith(tests)
    # The set-up commands are the first two code blocks of any kind.
    first = [code.strip() for _, code, _, _ in blocks(ROOT / "README.md")[:2]]
    assert first == [main_job, tests]


def test_the_set_up_commands_install_what_they_need():
    extras = configparser.ConfigParser()
    extras.read(ROOT / "setup.cfg")
    core = extras["options"]["install_requires"]
    extras = extras["options.extras_require"]
    assert "tensorflow" not in core and "matplotlib" not in core and "sphinx" not in core
    main_job, tests = (set(re.search(r'pip install -e "\.\[([\w,]+)\]"', block).group(1).split(","))
                       for block in setup_blocks())
    # The main job draws its curves; the tests read tf.data, run the notebooks, build the docs.
    assert main_job == {"plot"} and "matplotlib" in extras["plot"]
    assert tests == {"test"}
    for needed in ("tensorflow-cpu", "grain", "matplotlib", "pytest", "nbclient",
                   "sphinx", "myst-nb", "sphinx-book-theme"):
        assert needed in extras["test"]
    for needed in ("sphinx", "myst-nb", "sphinx-book-theme", "matplotlib"):
        assert needed in extras["docs"]


def test_readme_is_a_front_page_without_dates_machines_or_logs():
    lines = README.count("\n") + 1
    assert lines <= 200, f"README.md has {lines} lines; the reference belongs in docs/"
    assert not dates(README), dates(README)
    assert not machines(README), machines(README)
    for log in ("samples/s", "GFLOP/s", "passed,", "val_accuracy: 0."):
        assert log not in README, f"a benchmark or test log in README.md: {log!r}"
    # It says how to install JAX for accelerators and names every extra.
    assert '"jax[cuda12]"' in README and '"jax[tpu]"' in README
    extras = configparser.ConfigParser()
    extras.read(ROOT / "setup.cfg")
    for extra in extras["options.extras_require"]:
        assert f"`{extra}`" in README, f"README.md does not name the {extra} extra"


MONTHS = ("January|February|March|April|May|June|July|August|September|October|November|"
          "December|Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec")
DATE = re.compile(rf"\b(20\d\d-[01]\d-[0-3]\d|(?:{MONTHS})\.? [0-3]?\d,? 20\d\d|[0-3]?\d (?:{MONTHS})\.? 20\d\d)\b")
# The CPUs and machines measurements ran on; they belong on the benchmarks page.
MACHINE = re.compile(r"\b(Xeon|EPYC|Intel|AMD|Ryzen|Threadripper|Graviton|VM|vCPU)\b")


def dates(text):
    return DATE.findall(text)


def machines(text):
    return MACHINE.findall(text)


def test_the_date_and_machine_checks_catch_what_they_are_for():
    assert dates("measured on 2026-11-24 18:54 UTC") and dates("on Nov 24, 2026")
    assert not dates("2048 training images, 1,000 rows, keras 3.15.1, jax 0.10.2")
    assert machines("a 2-core AMD EPYC VM") and machines("an Intel Xeon")
    assert not machines("2 simulated devices on the CPU, an NVIDIA GPU")


# Pages where dates and machines belong: the measurements and the history.
DATED_PAGES = {"docs/benchmarks.md", "docs/changelog.md"}


@pytest.mark.parametrize("path", [path for path in PAGES if rel(path) not in DATED_PAGES],
                         ids=rel)
def test_guides_carry_no_dates_or_machine_names(path):
    text = path.read_text()
    assert not dates(text), f"{rel(path)}: dates belong on docs/benchmarks.md or CHANGELOG.md"
    assert not machines(text), f"{rel(path)}: machines belong on docs/benchmarks.md"


# --- Every block is run, shown as output, or marked not run ---------------------


def test_every_block_is_run_or_marked_not_run():
    not_run = []
    for path in PAGES:
        for language, _, line, before in blocks(path):
            if language in ("python", "bash") or language.startswith("{"):
                continue
            if language == "text":  # output, not a command
                continue
            last = before.rstrip("\n").rsplit("\n", 1)[-1]
            assert NOT_RUN.search(last), (
                f"{rel(path)}:{line}: a ```{language} block that no test runs needs a "
                "'<!-- not run: why -->' line before it (or make it ```python or ```bash)")
            not_run.append(f"{rel(path)}:{line}")
    assert len(not_run) <= MAX_NOT_RUN, not_run


def test_text_blocks_are_output_not_commands():
    for path in PAGES:
        for language, code, line, _ in blocks(path):
            if language == "text":
                first = code.lstrip().split(None, 1)[0] if code.strip() else ""
                assert first not in ("$", "python", "pip", "keras-dp", "bash", "sphinx-build"), (
                    f"{rel(path)}:{line}: a command in a ```text block: make it ```bash")


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
    """Each page's Python blocks grouped into interpreter sessions: `(id, blocks)`."""
    groups = []
    for path in PAGES:
        page = []
        for language, code, line, _ in blocks(path):
            if language != "python":
                continue
            if free_names(code) and page:
                page[-1][1].append(code)
            else:
                page.append((f"{rel(path)}:{line}", [code]))
        groups += page
    return groups


SESSIONS = sessions()


def test_the_blocks_group_into_sessions():
    # A page's first block stands alone: a session never reaches across pages.
    for path in PAGES:
        python = [code for language, code, _, _ in blocks(path) if language == "python"]
        if python:
            assert not free_names(python[0]), (rel(path), free_names(python[0]))
    assert {name.split(":")[0]: len(blocks_) for name, blocks_ in SESSIONS} == {
        "README.md": 1,
        "docs/guides/ensembles.md": 1,
        "docs/guides/grain.md": 1,
        "docs/guides/how-it-works.md": 2,  # the trainer by hand, then its epochs
        "docs/guides/many-hosts.md": 1,
        "docs/guides/memory.md": 4,  # the plan, micro-batches, remat, sharded birth: one session
        "docs/guides/model-axis.md": 1,
        "docs/guides/performance.md": 1,
        "docs/guides/preemption.md": 1,
        "docs/guides/sharded-state.md": 1,
    }


@pytest.fixture
def small_mnist(tmp_path):
    from keras_dp import datasets

    (x, y), (x_test, y_test) = datasets.load_mnist(datasets.BUNDLED_MNIST)
    data = tmp_path / "data"
    data.mkdir()
    np.savez(data / "mnist.npz", x_train=x[:512], y_train=y[:512],
             x_test=x_test[:256], y_test=y_test[:256])
    return data


def environment(directory, data_dir):
    env = {key: value for key, value in os.environ.items() if key != "KERAS_BACKEND"}
    env.update(KERAS_DP_DATA_DIR=str(data_dir), KERAS_HOME=str(directory / "keras_home"),
               XLA_FLAGS="--xla_force_host_platform_device_count=2",
               PATH=os.pathsep.join([str(pathlib.Path(sys.executable).parent), env.get("PATH", "")]))
    return env


def run_session(blocks_, directory, data_dir):
    script = directory / "session.py"
    script.write_text("\n".join(blocks_))
    command = [sys.executable, str(script)]
    if "distributed.initialize()" in script.read_text():  # one process per host: try it on 2
        command = [sys.executable, "-m", "keras_dp", "launch", "--processes", "2",
                   "--cpu-devices", "1", "--", *command]
    return subprocess.run(command, cwd=directory, env=environment(directory, data_dir),
                          capture_output=True, text=True, timeout=280)


def _slow_python(blocks_):
    # The many-hosts block runs as 2 launched processes (about 30 s on a
    # 2-core machine, idle); tests/test_distributed.py launches `keras-dp
    # train` the same way in every run, so this one waits for --runslow.
    return [pytest.mark.slow] if "distributed.initialize()" in "".join(blocks_) else []


@pytest.mark.parametrize("name, blocks_", [
    pytest.param(name, blocks_, marks=_slow_python(blocks_), id=name) for name, blocks_ in SESSIONS
])
def test_python_blocks_run_as_written(name, blocks_, tmp_path, small_mnist):
    work = tmp_path / "work"
    work.mkdir()
    result = run_session(blocks_, work, small_mnist)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    text = "\n".join(blocks_)
    if 'model.save("convnet.keras")' in text and "initialize" not in text:
        model = keras.saving.load_model(work / "convnet.keras")
        assert model.count_params() == 49_378
        assert "Epoch 2/2" in result.stdout
    if ".as_text()" in text:
        assert "all-reduce" in result.stdout  # 2 devices: the gradients are summed
    if "memory_plan" in text:
        mode = "full" if 'state_sharding="full"' in text else "replicated"
        assert re.search(rf"Memory per device \(2 devices, state_sharding='{mode}'\)",
                         result.stdout)
    if "capacity=" in text:  # a plan that does not fit says which changes would
        assert re.search(r"does not fit\n(.*\n)*  with micro_batches=4: peak .*: fits",
                         result.stdout)


def bash_blocks():
    """Each ```bash block but README's two set-up commands: `(id, code)`."""
    found = []
    for path in PAGES:
        for language, code, line, _ in blocks(path):
            if language == "bash" and code.strip() not in setup_blocks():
                found.append((f"{rel(path)}:{line}", code))
    return found


def _slow_bash(code):
    # Training end to end, or launching processes: tests/test_cli.py and
    # tests/test_distributed.py run those in the default suite already.
    return [pytest.mark.slow] if re.search(r"keras-dp (train|launch)(?!.*--help)", code) else []


@pytest.mark.parametrize("name, code", [
    pytest.param(name, code, marks=_slow_bash(code), id=name) for name, code in bash_blocks()
])
def test_bash_blocks_run_as_written(name, code, tmp_path, small_mnist):
    work = tmp_path / "work"
    work.mkdir()
    result = subprocess.run(["bash", "-e", "-c", code], cwd=work,
                            env=environment(work, small_mnist),
                            capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    if "device_count" in code:
        assert result.stdout.split()[-1] == re.search(r"count=(\d+)", code).group(1)
