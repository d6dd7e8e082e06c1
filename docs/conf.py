"""Sphinx configuration of keras_dp's documentation.

Build (from the repository root):

    sphinx-build -W --keep-going -b html docs docs/_build/html

The tutorials (notebooks/*.ipynb, linked into docs/tutorials/) are rendered
without outputs unless KERAS_DP_DOCS_EXECUTE=1, which executes them through
myst-nb's cache (jupyter-cache, in docs/_build/.jupyter_cache unless
KERAS_DP_DOCS_CACHE says otherwise) on the small MNIST slices the tests use.
"""

import importlib.util
import os
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import keras_dp  # noqa: E402  (selects Keras's JAX backend for autodoc's imports)

project = "keras_dp"
author = "the keras_dp authors"
copyright = "the keras_dp authors"
release = version = keras_dp.__version__

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

# Not pages of the site: the old-README-to-page table, the build's output.
exclude_patterns = ["_build", "_migration.md", "**.ipynb_checkpoints", "Thumbs.db", ".DS_Store"]

# --- Markdown and notebooks (myst-parser, myst-nb) ---------------------------
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# Executing the notebooks trains models: off unless asked for.
EXECUTE = os.environ.get("KERAS_DP_DOCS_EXECUTE", "0") not in ("", "0")
nb_execution_mode = "cache" if EXECUTE else "off"
nb_execution_cache_path = os.environ.get(
    "KERAS_DP_DOCS_CACHE", str(ROOT / "docs" / "_build" / ".jupyter_cache"))
nb_execution_timeout = 900
nb_execution_in_temp = True  # files a notebook saves go to a temporary directory
nb_execution_raise_on_error = True
nb_execution_show_tb = True
# A tutorial that needs a package the [test] extra leaves out is rendered
# without outputs where it is not installed (keras_hub: see setup.cfg's [hub]).
nb_execution_excludepatterns = [
    f"tutorials/{name}.ipynb" for name, package in (("08_model_axis", "keras_hub"),)
    if importlib.util.find_spec(package) is None]
if EXECUTE:
    # The slices tests/test_notebooks.py runs on: 1,024 MNIST images, one
    # epoch, 256 for ResNet-18. The kernels inherit this environment.
    os.environ.setdefault("KERAS_DP_NOTEBOOK_SAMPLES", "1024")
    os.environ.setdefault("KERAS_DP_NOTEBOOK_EPOCHS", "1")
    os.environ.setdefault("KERAS_DP_NOTEBOOK_RESNET_SAMPLES", "256")

# --- API reference (autodoc, autosummary, napoleon) --------------------------
autodoc_default_options = {"members": True, "member-order": "bysource"}
autodoc_typehints = "description"
autodoc_preserve_defaults = True
autosummary_generate = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True  # a NamedTuple's "Attributes:" beside its fields' own entries
# The docstrings are written with Markdown's `code` spans.
default_role = "code"

_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>\w*)[ \t]*$")
_NAMES_GO_ON = re.compile(r"^\s+\w+(, \w+)*,$")  # "a, b," : an argument list that wraps
_CODE_SPAN = re.compile(r"(`[^`\n]+`)(\w?)")  # a suffix: `ShapeDtypeStruct`s


def markdown_to_rest(lines):
    """The docstrings are Markdown-flavoured Google style; make them reST.

    Code fences become code-block directives, a code span with a suffix
    (`` `Array`s ``) gets reST's escaped space, and an argument list that
    wraps onto the next line is joined, so napoleon reads all its names.
    """
    out, fence = [], None
    for line in lines:
        match = _FENCE.match(line)
        if fence is None and match:
            fence = match.group("indent")
            out += [f"{fence}.. code-block:: {match.group('lang') or 'text'}", ""]
        elif fence is not None and match and match.group("indent") == fence:
            fence = None
            out.append("")
        elif fence is not None:
            out.append(f"{fence}   {line[len(fence):]}" if line.strip() else "")
        elif out and _NAMES_GO_ON.match(out[-1]):
            out[-1] = f"{out[-1]} {line.strip()}"
        else:
            out.append(_CODE_SPAN.sub(lambda m: m[1] + ("\\ " + m[2] if m[2] else ""), line))
    return out


def _markdown_to_rest(app, what, name, obj, options, lines):
    lines[:] = markdown_to_rest(lines)


# --- Every public name documented ---------------------------------------------


def public_names():
    """`keras_dp.<name>` of every public name: `keras_dp.__all__`, and the
    functions and classes the public modules define."""
    import importlib
    import inspect

    names = []
    for name in keras_dp.__all__:
        value = getattr(keras_dp, name)
        if inspect.ismodule(value):
            module = importlib.import_module(f"keras_dp.{name}")
            for member, member_value in vars(module).items():
                if member.startswith("_"):
                    continue
                if ((inspect.isfunction(member_value) or inspect.isclass(member_value))
                        and member_value.__module__ == module.__name__):
                    names.append(f"keras_dp.{name}.{member}")
        else:
            names.append(f"keras_dp.{name}")
    return names


def _check_coverage(app, env):
    """Warn (an error under -W) for a public name the reference leaves out,
    and for one documented under an internal module's path."""
    from sphinx.util import logging

    logger = logging.getLogger(__name__)
    objects = env.domaindata["py"]["objects"]
    # autodoc records a class's defining module as an alias (`:canonical:`):
    # drop it, so that no internal path reaches the index or objects.inv.
    for name in [name for name, entry in objects.items() if entry.aliased]:
        del objects[name]
    documented = set(objects)
    for name in public_names():
        if name not in documented:
            logger.warning("public name %s has no entry in the API reference (docs/api.md)", name)
    for name in sorted(documented):
        module = name.split(".")[1] if name.count(".") else ""
        if name.startswith("keras_dp.") and module not in keras_dp.__all__:
            logger.warning("%s is documented under an internal module's path: document "
                           "it as keras_dp.<public name>", name)


def setup(app):
    # Before napoleon (priority 500) reads the sections.
    app.connect("autodoc-process-docstring", _markdown_to_rest, priority=100)
    app.connect("env-check-consistency", _check_coverage)


# --- Theme -----------------------------------------------------------------
html_theme = "sphinx_book_theme"
html_title = f"keras_dp {release}"
html_static_path = ["_static"]
html_css_files = ["custom.css"]
html_theme_options = {
    "show_toc_level": 2,
    "navigation_with_keys": False,
}
