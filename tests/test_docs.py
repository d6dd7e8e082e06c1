"""The documentation site builds, strict, and documents every public name.

The build is README's command (`sphinx-build -W --keep-going -b html docs
docs/_build/html`), into a temporary directory, with the notebooks rendered
without outputs; with --runslow it runs again with the notebooks executed
(`KERAS_DP_DOCS_EXECUTE=1`) through myst-nb's cache. Every public name
(`keras_dp.__all__`, and the functions and classes of its public modules)
must have an entry in the API reference, under `keras_dp.<name>`, never
under the internal module that defines it. The examples in the public
docstrings run as written.
"""

import ast
import importlib
import inspect
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import time

import nbformat
import pytest

import keras_dp

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BIN = pathlib.Path(sys.executable).parent


def build_command(out):
    """README's docs command, its install left out, building into `out`."""
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"^\$ (pip install -e \"\.\[docs\]\" && sphinx-build .*)$", readme,
                        flags=re.M).group(1)
    build = shlex.split(command.split("&&")[-1])
    assert build[0] == "sphinx-build" and build[-2:] == ["docs", "docs/_build/html"], build
    assert "-W" in build and "--keep-going" in build  # strict
    return [str(BIN / "sphinx-build"), *build[1:-1], str(out)]


def build(out, execute=False, builder="html", source=None, timeout=600, **env):
    environment = {key: value for key, value in os.environ.items()
                   if not key.startswith("KERAS_DP_DOCS_")}
    # As on a new machine: each notebook chooses its backend and its 4
    # simulated devices itself (this test process has 8).
    environment.pop("KERAS_BACKEND", None)
    environment.pop("XLA_FLAGS", None)
    if execute:
        environment["KERAS_DP_DOCS_EXECUTE"] = "1"
    environment.update(env)
    command = build_command(out)
    if source is not None:
        command[command.index("docs")] = str(source)
    command[command.index("-b") + 1] = builder
    started = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True,
                            text=True, timeout=timeout)
    return result, time.perf_counter() - started


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("html")
    result, seconds = build(out)
    print(f"docs build: {seconds:.1f} s")
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    return out, result


def test_the_docs_build_in_strict_mode_with_every_page(site):
    out, result = site
    assert "warning" not in result.stderr.lower(), result.stderr[-4000:]
    for page in ["index", "install", "tutorials", "api", "benchmarks", "changelog", "internals",
                 *(f"guides/{path.stem}" for path in (DOCS / "guides").glob("*.md"))]:
        assert (out / f"{page}.html").is_file(), page
    # The migration table is not a page of the site.
    assert not (out / "_migration.html").exists()


def public_names():
    """`keras_dp.<name>` of every public name: those in `keras_dp.__all__`,
    and the functions and classes the public modules define."""
    names = []
    for name in keras_dp.__all__:
        value = getattr(keras_dp, name)
        names.append(f"keras_dp.{name}")
        if inspect.ismodule(value):
            module = importlib.import_module(f"keras_dp.{name}")
            names += [f"keras_dp.{name}.{member}" for member, member_value in vars(module).items()
                      if not member.startswith("_")
                      and (inspect.isfunction(member_value) or inspect.isclass(member_value))
                      and member_value.__module__ == module.__name__]
    return names


def inventory(out):
    from sphinx.util.inventory import InventoryFile

    with open(out / "objects.inv", "rb") as handle:
        loaded = InventoryFile.load(handle, "", lambda *parts: "/".join(parts))
    entries = getattr(loaded, "data", loaded)
    return {name for kind, names in entries.items() if kind.startswith("py:") for name in names}


def test_every_public_name_is_documented_under_its_public_path(site):
    out, _ = site
    documented = inventory(out)
    missing = [name for name in public_names() if name not in documented]
    assert not missing, f"public names without an entry in docs/api.md: {missing}"
    # Nothing is documented through an internal module (keras_dp.trainer, ...):
    # those are being renamed; the public path is the one users import.
    public = {f"keras_dp.{name}" for name in keras_dp.__all__}
    internal = [name for name in documented
                if not any(name == p or name.startswith(p + ".") for p in public)]
    assert not internal, internal
    # The classes' methods are documented too.
    for method in ("ShardedTrainer.fit", "ShardedTrainer.evaluate", "ShardedTrainer.predict",
                   "EnsembleTrainer.fit", "TrainState.from_model"):
        assert f"keras_dp.{method}" in documented, method


def test_the_build_fails_when_a_public_name_has_no_entry(tmp_path):
    source = tmp_path / "docs"
    shutil.copytree(DOCS, source, symlinks=True, ignore=shutil.ignore_patterns("_build"))
    for link in (source / "tutorials").glob("*.ipynb"):  # the links point out of docs/
        link.unlink()
        link.symlink_to(ROOT / "notebooks" / link.name)
    api = source / "api.md"
    api.write_text(api.read_text().replace(".. autofunction:: keras_dp.make_mesh\n", ""))
    result, _ = build(tmp_path / "out", builder="dummy", source=source)
    assert result.returncode != 0
    assert "public name keras_dp.make_mesh has no entry" in result.stderr


def test_every_notebook_is_a_tutorial_page():
    notebooks = sorted(path.name for path in (ROOT / "notebooks").glob("*.ipynb"))
    linked = sorted(path.name for path in (DOCS / "tutorials").glob("*.ipynb"))
    assert linked == notebooks
    for link in (DOCS / "tutorials").glob("*.ipynb"):
        assert link.is_symlink() and link.resolve() == (ROOT / "notebooks" / link.name).resolve()
    toctree = (DOCS / "tutorials.md").read_text()
    for name in notebooks:
        assert f"tutorials/{pathlib.Path(name).stem}\n" in toctree, name


@pytest.mark.slow
def test_the_docs_build_with_the_notebooks_executed_and_cached(tmp_path):
    cache = tmp_path / "cache"
    # The small slices tests/test_notebooks.py runs on (docs/conf.py's defaults).
    small = dict(KERAS_DP_DOCS_CACHE=str(cache), KERAS_DP_NOTEBOOK_SAMPLES="1024",
                 KERAS_DP_NOTEBOOK_EPOCHS="1", KERAS_DP_NOTEBOOK_RESNET_SAMPLES="256")
    result, seconds = build(tmp_path / "html", execute=True, timeout=1500, **small)
    print(f"docs build, notebooks executed: {seconds:.1f} s")
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    page = (tmp_path / "html" / "tutorials" / "01_quickstart.html").read_text()
    # Keras's logs, the 4 simulated devices the notebook asks for, its curves.
    assert "val_accuracy" in page and "cpu:3" in page and "cpu:4" not in page
    assert "<img" in page
    assert cache.is_dir()
    # A second build finds every notebook in the cache and runs none.
    again, _ = build(tmp_path / "html2", execute=True, timeout=600, **small)
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    assert "Executing notebook" not in again.stdout + again.stderr
    # Building leaves the notebooks as committed: no outputs.
    for path in (ROOT / "notebooks").glob("*.ipynb"):
        notebook = nbformat.read(path, as_version=4)
        assert all(not cell.get("outputs") for cell in notebook.cells), path.name


# --- The examples in the public docstrings --------------------------------------


def docstring_examples():
    """`(name, code)` of each ```python block in a public name's docstring."""
    found = []
    for name in public_names():
        obj = keras_dp
        for part in name.split(".")[1:]:
            obj = getattr(obj, part)
        objects = [(name, obj)]
        if inspect.isclass(obj):
            objects += [(f"{name}.{member}", value) for member, value in vars(obj).items()
                        if not member.startswith("_")]
        for object_name, value in objects:
            doc = inspect.getdoc(value) or ""
            for index, code in enumerate(re.findall(r"```python\n(.*?)```", doc, flags=re.S)):
                found.append((f"{object_name}[{index}]", code))
    return found



def test_the_public_docstrings_hold_examples():
    names = {name for name, _ in docstring_examples()}
    assert "keras_dp.fit_sharded[0]" in names


@pytest.mark.parametrize("name, code", [
    pytest.param(name, code, id=name) for name, code in docstring_examples()])
def test_docstring_examples_run_as_written(name, code, tmp_path):
    ast.parse(code)
    from keras_dp import datasets
    import numpy as np

    (x, y), (x_test, y_test) = datasets.load_mnist(datasets.BUNDLED_MNIST)
    np.savez(tmp_path / "mnist.npz", x_train=x[:512], y_train=y[:512],
             x_test=x_test[:256], y_test=y_test[:256])
    env = {key: value for key, value in os.environ.items() if key != "KERAS_BACKEND"}
    env.update(KERAS_DP_DATA_DIR=str(tmp_path), KERAS_HOME=str(tmp_path / "keras_home"),
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    script = tmp_path / "example.py"
    script.write_text(code)
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
