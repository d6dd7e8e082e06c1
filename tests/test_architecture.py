"""The package's layout holds: layers imported only downwards, no cycle, small modules and functions.

The layers are written once, as import-linter's contract in setup.cfg; this
checks that contract and what it cannot say: that no two modules import
each other (within a layer too), that `trainer.py` stays a composition root
of few imports, that no module or function grows past its size, that the
process count is asked of the hosts, and that one batch of arrays crosses
few modules on its way to the compiled step (`scripts/batch_route.py`).
"""

import ast
import configparser
import io
import pathlib
import re
import subprocess
import sys
import tokenize

import grimp
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "keras_dp"
MAX_MODULE_LINES = 500
MAX_FUNCTION_CODE_LINES = 60
MAX_TRAINER_IMPORTS = 12
MAX_ROUTE_MODULES = 10
# Where keras_dp asks how many processes there are: the hosts, the trainer's
# public `multiprocess`, the CLI's report, and a PyDataset's own argument.
MAX_MODULES_NAMING_MULTIPROCESS = 5


def modules():
    """`{dotted name: path}` of every module of the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def code_lines(source):
    """The line numbers of `source` that hold code: no docstring, comment or blank line."""
    tree = ast.parse(source)
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(
                    getattr(body[0], "value", None), ast.Constant) and isinstance(
                    body[0].value.value, str):
                docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE,
                              tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            lines.update(range(token.start[0], token.end[0] + 1))
    return lines - docstrings


def test_imports_go_down_the_layers_of_setup_cfg():
    code = (f"import os, sys; os.chdir({str(ROOT)!r}); from importlinter.cli import lint_imports; "
            "sys.exit(lint_imports(no_cache=True))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout


def test_every_module_is_in_a_layer():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    layers = config["importlinter:contract:layers"]["layers"]
    named = {name.strip() for line in layers.split("\n") for name in line.split("|")
             if name.strip()}
    top = {name for name in modules() if name.count(".") <= 1} - {"keras_dp"}
    assert top <= named, f"modules in no layer of setup.cfg: {sorted(top - named)}"


def test_no_two_modules_import_each_other_even_through_others():
    graph = grimp.build_graph("keras_dp")
    cycles = []
    for module in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(module):
            if module != imported and graph.chain_exists(importer=imported, imported=module):
                cycles.append(graph.find_shortest_chain(importer=imported, imported=module)
                              + (imported,))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles[:5])


def test_the_trainer_is_a_composition_root_of_few_imports():
    graph = grimp.build_graph("keras_dp")
    imported = {name for name in graph.find_modules_directly_imported_by("keras_dp.trainer")
                if name.startswith("keras_dp")}
    assert len(imported) <= MAX_TRAINER_IMPORTS, sorted(imported)


def test_modules_and_functions_stay_small():
    too_long, too_big = [], []
    for name, path in modules().items():
        source = path.read_text()
        if source.count("\n") > MAX_MODULE_LINES:
            too_long.append((name, source.count("\n")))
        lines = code_lines(source)
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = len([n for n in lines if node.lineno <= n <= node.end_lineno])
                if size > MAX_FUNCTION_CODE_LINES:
                    too_big.append((f"{name}.{node.name}", size))
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines: {too_long}"
    assert not too_big, f"functions over {MAX_FUNCTION_CODE_LINES} lines of code: {too_big}"


def test_the_process_count_is_asked_of_the_hosts():
    naming = sorted(name for name, path in modules().items()
                    if ".multihost" not in name and re.search("multiprocess", path.read_text()))
    assert len(naming) <= MAX_MODULES_NAMING_MULTIPROCESS, naming


def test_one_batch_of_arrays_crosses_few_modules():
    for flag in ([], ["--host"]):
        result = subprocess.run([sys.executable, str(ROOT / "scripts" / "batch_route.py"), *flag],
                                capture_output=True, text=True, timeout=240)
        assert result.returncode == 0, result.stderr[-2000:]
        line = result.stdout.strip().splitlines()[-1]
        count = int(line.split()[0])
        assert count <= MAX_ROUTE_MODULES, line


@pytest.mark.parametrize("name", ["fit_sharded", "ShardedTrainer", "make_mesh", "memory_plan",
                                  "TrainState", "fit_ensemble", "shard_for_processes"])
def test_public_names_stay_importable_from_the_package(name):
    import keras_dp

    assert getattr(keras_dp, name) is not None and name in keras_dp.__all__
