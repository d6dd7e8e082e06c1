"""API.md is the docstrings, rendered: up to date, complete, nothing undocumented."""

import difflib
import importlib.util
import inspect
import os
import pathlib
import pkgutil
import re
import subprocess
import sys

import pytest

import keras_dp

ROOT = pathlib.Path(__file__).resolve().parents[1]
API_MD = ROOT / "API.md"
REGENERATE = "run python scripts/make_api_doc.py"

# Public names documented in API.md whose docstring is missing or a single
# word. Add the docstring, then delete the name here: the test fails while a
# name listed here has a proper docstring, so the list cannot go stale.
KNOWN_UNDOCUMENTED = set()


def load_script():
    path = ROOT / "scripts" / "make_api_doc.py"
    spec = importlib.util.spec_from_file_location("make_api_doc", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def script():
    return load_script()


@pytest.fixture(scope="module")
def rendered(script):
    return script.render()


def test_api_md_is_up_to_date(rendered):
    committed = API_MD.read_text() if API_MD.exists() else ""
    if committed != rendered:
        diff = "".join(list(difflib.unified_diff(
            committed.splitlines(keepends=True), rendered.splitlines(keepends=True),
            "API.md (committed)", "API.md (rendered)",
        ))[:60])
        pytest.fail(f"API.md is stale: {REGENERATE}\n{diff}")


def test_check_mode_agrees_on_one_device():
    """The script, run as a command on one CPU device (the test process has
    8), passes its own --check: the text does not depend on the devices."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_api_doc.py"), "--check"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, f"API.md is stale: {REGENERATE}\n{result.stderr[-2000:]}"


def exported_names():
    names = getattr(keras_dp, "__all__", None)
    if names is not None:
        return list(names)
    return [
        name for name, value in vars(keras_dp).items()
        if not name.startswith("_") and (inspect.isfunction(value) or inspect.isclass(value))
    ]


def headings(text):
    """The Markdown headings outside fenced code blocks."""
    found, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            found.append(line.lstrip("#").strip())
    return found


def test_every_exported_name_is_documented(rendered):
    heading_set = set(headings(rendered))
    for name in exported_names():
        value = getattr(keras_dp, name)
        assert f"`keras_dp.{name}`" in rendered, f"keras_dp.{name} is not in API.md"
        if inspect.ismodule(value):
            target = value.__name__
        else:
            target = f"{value.__module__}.{value.__name__}"
        assert f"`{target}`" in heading_set, f"API.md has no section for {target}"


def test_every_module_is_documented(rendered):
    heading_set = set(headings(rendered))
    for info in pkgutil.walk_packages(keras_dp.__path__, "keras_dp."):
        name = info.name
        if not name.rsplit(".", 1)[-1].startswith("_"):  # _compat, __main__
            assert f"`{name}`" in heading_set, f"API.md has no section for {name}"


def test_every_link_has_its_heading(script, rendered):
    anchors = {script.anchor(heading) for heading in headings(rendered)}
    links = re.findall(r"\]\(#([^)]*)\)", rendered)
    assert links
    assert sorted(set(links) - anchors) == []


def test_every_public_name_has_a_docstring(script):
    lacking = sorted(
        name for name, obj in script.documented_objects()
        if len(script.doc(obj).split()) < 2
    )
    assert sorted(set(lacking) - KNOWN_UNDOCUMENTED) == [], (
        "public names without a docstring (or with a one-word one): add one"
    )
    assert sorted(KNOWN_UNDOCUMENTED - set(lacking)) == [], (
        "documented now: remove these from KNOWN_UNDOCUMENTED"
    )
