"""Every tutorial notebook runs top to bottom, on a small slice of MNIST.

The notebooks are committed without outputs (a clean diff, no stale
numbers); this test executes each in a fresh kernel with 4 simulated CPU
devices and fails on the first cell that raises.
"""

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).parents[1] / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks_and_they_are_committed_clean():
    assert len(NOTEBOOKS) >= 8
    for path in NOTEBOOKS:
        notebook = nbformat.read(path, as_version=4)
        for cell in notebook.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, path.name


def test_each_notebook_opens_with_its_install_command_and_no_notes_for_ci():
    # They are read as tutorials (docs/tutorials.md renders them): the
    # install comes first, and how the tests run them is this file's business.
    for path in NOTEBOOKS:
        notebook = nbformat.read(path, as_version=4)
        opening = notebook.cells[:3]
        setup = [cell for cell in opening if cell.cell_type == "markdown"
                 and cell.source.startswith("## Setup")]
        assert setup and 'pip install -e ".[plot]"' in setup[0].source, path.name
        for cell in opening:
            assert "CI" not in cell.source.split() and "tests/" not in cell.source, path.name


# The notebooks run with --runslow (ResNet-18's alone takes a minute on a
# 2-core CPU, and each repeats what a test file checks), which keeps the
# suite within its 10 minutes; CI checks they are committed clean.
SLOW_NOTEBOOKS = {"01_quickstart", "02_inside_the_trainer", "03_many_steps_per_call", "04_ensembles",
                  "05_resnet18", "06_many_hosts", "07_bring_your_own_model", "08_model_axis"}
# Notebooks that need a package outside the [test] extra, and how to install it.
NEEDS = {"08_model_axis": ("keras_hub", "keras_hub is not installed (not in the [test] extra: "
                           "it would bring full TensorFlow beside tensorflow-cpu); "
                           "pip install --no-deps keras-hub==0.32.0 regex tokenizers")}


@pytest.mark.parametrize("path", [
    pytest.param(path, marks=pytest.mark.slow) if path.stem in SLOW_NOTEBOOKS else path
    for path in NOTEBOOKS], ids=[path.stem for path in NOTEBOOKS])
def test_notebook_runs(path, tmp_path, monkeypatch):
    if path.stem in NEEDS:
        pytest.importorskip(NEEDS[path.stem][0], reason=NEEDS[path.stem][1])
    # The kernel inherits this environment: small data, one epoch, 4 devices.
    monkeypatch.setenv("KERAS_DP_NOTEBOOK_SAMPLES", "1024")
    monkeypatch.setenv("KERAS_DP_NOTEBOOK_EPOCHS", "1")
    # ResNet-18 (notebook 5) trains ~100x fewer images/s than the convnet on this CPU.
    monkeypatch.setenv("KERAS_DP_NOTEBOOK_RESNET_SAMPLES", "256")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    # As for a user: each notebook must choose Keras's backend itself.
    monkeypatch.delenv("KERAS_BACKEND", raising=False)
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(notebook, timeout=240, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = "".join(
        output.get("text", "") for cell in notebook.cells for output in cell.get("outputs", [])
    )
    assert "Traceback" not in outputs
    # Files a notebook makes go to a temporary directory, not beside it, so
    # that running the notebooks leaves a clone's `git status` clean.
    assert sorted(path.name for path in tmp_path.iterdir()) == []
