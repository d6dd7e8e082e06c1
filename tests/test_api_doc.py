"""API.md is the docstrings, rendered, and covers every public name."""

import importlib.util
import pathlib

import keras_dp

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_script():
    spec = importlib.util.spec_from_file_location("make_api_doc", ROOT / "scripts" / "make_api_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_md_is_up_to_date_and_every_public_name_has_a_docstring():
    text = load_script().render()
    assert (ROOT / "API.md").read_text() == text, (
        "API.md is stale: run python scripts/make_api_doc.py"
    )
    assert "_(no docstring)_" not in text
    for name in keras_dp.__all__:
        assert f"`{name}" in text or f"keras_dp.{name}" in text, name
