"""Write API.md, the API reference, from the package's docstrings.

    python scripts/make_api_doc.py          # rewrite API.md
    python scripts/make_api_doc.py --check  # exit 1 if API.md is stale

tests/test_api_doc.py checks that API.md equals `render()`, so the reference
cannot drift from the code. The output is deterministic: source order, no
timestamps, no absolute paths, nothing that depends on the device count.
"""

import argparse
import ast
import contextlib
import importlib
import inspect
import os
import pathlib
import pkgutil
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
COMMAND = "python scripts/make_api_doc.py"

# Most used first; then the parts, in the order the trainer uses them. A
# module of the package missing here is still documented, after these.
MODULES = [
    "keras_dp.api",
    "keras_dp.trainer",
    "keras_dp.ensemble",
    "keras_dp.checkpoint.store",
    "keras_dp.checkpoint.preemption",
    "keras_dp.distributed",
    "keras_dp.multihost.agreement",
    "keras_dp.models",
    "keras_dp.datasets",
    "keras_dp.sources",
    "keras_dp.core.feed",
    "keras_dp.diagnostics.compilation_cache",
    "keras_dp.core.loop",
    "keras_dp.core.evaluate",
    "keras_dp.core.steps",
    "keras_dp.core.state",
    "keras_dp.sharding",
    "keras_dp.keras.build",
    "keras_dp.checks.model",
    "keras_dp.keras.callbacks",
    "keras_dp.diagnostics.timing",
    "keras_dp.diagnostics.describe",
    "keras_dp.sources.batch",
    "keras_dp.sources.arrays",
    "keras_dp.sources.iterables",
    "keras_dp.sources.stream",
    "keras_dp.ensemble.trainer",
    "keras_dp.ensemble.members",
    "keras_dp.ensemble.steps",
    "keras_dp.ensemble.scores",
    "keras_dp.cli",
    "keras_dp.cli.train",
    "keras_dp.cli.launch",
    "keras_dp.cli.plots",
]
SKIPPED_MODULES = {"keras_dp.__main__"}  # just calls keras_dp.cli.main

# The `keras-dp` subcommands whose --help goes into the reference.
COMMANDS = ["train", "launch"]

SIMPLE_VALUES = (str, int, float, bool, type(None))
MAX_SIGNATURE_LINE = 88


# --- What is documented -----------------------------------------------------


def module_names():
    """Every module of the package to document, most used first."""
    import keras_dp

    found = {
        info.name for info in pkgutil.walk_packages(keras_dp.__path__, "keras_dp.")
        if not info.name.rsplit(".", 1)[-1].startswith("_")  # _compat, __main__
    }
    found -= SKIPPED_MODULES
    return [name for name in MODULES if name in found] + sorted(found - set(MODULES))


def _assigned_names(module):
    """`{name: line}` of the public names a module's own top level assigns."""
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError):
        return {}
    names = {}
    for node in tree.body:
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets = [node.target]
        for target in targets:
            if isinstance(target, ast.Name) and not target.id.startswith("_"):
                names.setdefault(target.id, node.lineno)
    return names


def _line(obj):
    try:
        return inspect.getsourcelines(obj)[1]
    except (OSError, TypeError):
        return sys.maxsize


def public_members(module):
    """`(name, value, kind)` of `module`'s own public names, in source order.

    `kind` is "class", "function" or "constant". Functions and classes count
    when defined in `module` (not imported into it); other values when an
    assignment at the module's top level makes them.
    """
    assigned = _assigned_names(module)
    members = []
    for name, value in vars(module).items():
        if name.startswith("_") or inspect.ismodule(value):
            continue
        if inspect.isclass(value) or inspect.isfunction(value):
            if getattr(value, "__module__", None) != module.__name__:
                continue
            if value.__name__ != name:  # an alias, such as `fit = fit_sharded`
                line = assigned.get(name, sys.maxsize)
                members.append((line, name, value, "constant"))
                continue
            kind = "class" if inspect.isclass(value) else "function"
            members.append((_line(value), name, value, kind))
        elif name in assigned:
            members.append((assigned[name], name, value, "constant"))
    members.sort(key=lambda member: (member[0], member[1]))
    return [(name, value, kind) for _, name, value, kind in members]


def class_members(cls):
    """`(name, value, kind)` of the public methods and properties `cls` defines.

    `kind` is "method", "classmethod", "staticmethod" or "property"; source
    order (the order of the class body).
    """
    members = []
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(value, classmethod):
            members.append((name, value.__func__, "classmethod"))
        elif isinstance(value, staticmethod):
            members.append((name, value.__func__, "staticmethod"))
        elif isinstance(value, property):
            members.append((name, value, "property"))
        elif inspect.isfunction(value):
            members.append((name, value, "method"))
    return members


def documented_objects():
    """`(qualified name, object)` of every module, function, class, method and
    property the reference documents (constants excluded): what should have
    a docstring."""
    objects = []
    for module_name in module_names():
        module = importlib.import_module(module_name)
        objects.append((module_name, module))
        for name, value, kind in public_members(module):
            if kind == "constant":
                continue
            objects.append((f"{module_name}.{name}", value))
            if kind == "class":
                for attr, member, _ in class_members(value):
                    objects.append((f"{module_name}.{name}.{attr}", member))
    return objects


# --- Rendering --------------------------------------------------------------


def doc(obj):
    """The dedented docstring (inherited for overriding methods), or ""."""
    return (inspect.getdoc(obj) or "").strip()


def first_paragraph(text):
    return " ".join(text.split("\n\n")[0].split())


def anchor(heading):
    """GitHub's anchor for a heading: lowercase, punctuation dropped."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _package_parent():
    import keras_dp

    return str(pathlib.Path(keras_dp.__file__).resolve().parents[1])


def _clean(text):
    """Drop what varies between runs or machines from a repr."""
    text = re.sub(r" at 0x[0-9a-fA-F]+", "", text)
    for base in sorted({_package_parent(), str(ROOT)}, key=len, reverse=True):
        text = text.replace(base + os.sep, "").replace(base, ".")
    return text


def _annotation(annotation):
    """`inspect.formatannotation`, with Keras's classes by their public name."""
    import keras

    if inspect.isclass(annotation) and annotation.__module__.startswith("keras.src"):
        if getattr(keras, annotation.__name__, None) is annotation:
            return f"keras.{annotation.__name__}"
    return _clean(inspect.formatannotation(annotation))


def _parameter(param):
    """`str(param)`, through `_annotation` and `_clean`."""
    text = param.name
    if param.annotation is not param.empty:
        text += f": {_annotation(param.annotation)}"
    if param.default is not param.empty:
        equals = " = " if param.annotation is not param.empty else "="
        text += equals + _clean(repr(param.default))
    if param.kind is param.VAR_POSITIONAL:
        text = "*" + text
    elif param.kind is param.VAR_KEYWORD:
        text = "**" + text
    return text


def signature(name, obj, drop_first=False):
    """`name(params) -> return`, one parameter a line when too long."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return f"{name}(...)"
    params = list(sig.parameters.values())
    if drop_first and params:
        params = params[1:]
    parts = []
    star_done = False
    for i, param in enumerate(params):
        if param.kind is param.VAR_POSITIONAL:
            star_done = True
        if param.kind is param.KEYWORD_ONLY and not star_done:
            parts.append("*")
            star_done = True
        parts.append(_parameter(param))
        is_last_positional_only = param.kind is param.POSITIONAL_ONLY and (
            i + 1 == len(params) or params[i + 1].kind is not param.POSITIONAL_ONLY
        )
        if is_last_positional_only:
            parts.append("/")
    returns = ""
    if sig.return_annotation is not inspect.Signature.empty:
        returns = " -> " + _annotation(sig.return_annotation)
    one_line = f"{name}({', '.join(parts)}){returns}"
    if len(one_line) <= MAX_SIGNATURE_LINE or not parts:
        return one_line
    body = "".join(f"    {part},\n" for part in parts)
    return f"{name}(\n{body}){returns}"


def _short(value):
    """A repr for a constant, or None when it has no stable, short one."""
    if isinstance(value, SIMPLE_VALUES):
        return _clean(repr(value))
    if inspect.isclass(value) or inspect.isfunction(value):
        return value.__qualname__ if value.__module__.startswith("keras_dp") else None
    if isinstance(value, (tuple, list)):
        items = [_short(item) for item in value]
        if None in items:
            return None
        if isinstance(value, list):
            return "[" + ", ".join(items) + "]"
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if isinstance(value, dict):
        items = [(_short(key), _short(item)) for key, item in value.items()]
        if any(None in pair for pair in items):
            return None
        return "{" + ", ".join(f"{key}: {item}" for key, item in items) + "}"
    return None


def constant_value(value):
    """`= repr` for plain values, else a comment with the type."""
    text = _short(value)
    if text is not None and len(text) <= MAX_SIGNATURE_LINE:
        return f" = {text}"
    if isinstance(value, pathlib.PurePath):
        return f"  # a path: {_clean(str(value))}"
    return f"  # a {type(value).__name__}"


def comment_above(module, line):
    """The `#` comment lines right above `line` of `module`'s source."""
    try:
        source = inspect.getsource(module).splitlines()
    except (OSError, TypeError):
        return ""
    comments = []
    index = line - 2
    while index >= 0 and source[index].lstrip().startswith("#"):
        comments.append(source[index].strip().lstrip("#").strip())
        index -= 1
    return " ".join(reversed(comments))


def code_block(text, language=""):
    return [f"```{language}", text.rstrip(), "```", ""]


def docstring_block(text):
    return [text, ""] if text else ["_(no docstring)_", ""]


def render_module(module_name):
    module = importlib.import_module(module_name)
    lines = [f"## `{module_name}`", ""]
    summary = first_paragraph(doc(module))
    if summary:
        lines += [summary, ""]
    assigned = _assigned_names(module)
    for name, value, kind in public_members(module):
        qualified = f"{module_name}.{name}"
        if kind == "constant":
            lines += [f"### `{qualified}`", ""]
            lines += code_block(f"{name}{constant_value(value)}", "python")
            comment = comment_above(module, assigned.get(name, 0))
            if comment:
                lines += [comment, ""]
            continue
        lines += [f"### `{qualified}`", ""]
        prefix = "class " if kind == "class" else ""
        lines += code_block(prefix + signature(name, value), "python")
        lines += docstring_block(doc(value))
        if kind != "class":
            continue
        for attr, member, member_kind in class_members(value):
            lines += [f"#### `{name}.{attr}`", ""]
            if member_kind == "property":
                lines += code_block(f"{name}.{attr}  # property", "python")
            else:
                decorator = "" if member_kind == "method" else f"@{member_kind}\n"
                drop_first = member_kind != "staticmethod"
                lines += code_block(
                    decorator + signature(f"{name}.{attr}", member, drop_first), "python"
                )
            base = inherited_from(value, attr, member)
            if base is not None:
                lines += [f"_(docstring inherited from `{public_name(base)}.{attr}`)_", ""]
            lines += docstring_block(doc(member))
    return lines


def inherited_from(cls, attr, member):
    """The base class `member` takes its docstring from, or None if its own."""
    if getattr(member, "__doc__", None) or not doc(member):
        return None
    for base in cls.__mro__[1:]:
        if getattr(getattr(base, attr, None), "__doc__", None):
            return base
    return None


def public_name(cls):
    """`keras.callbacks.Callback` rather than `keras.src.callbacks.callback.Callback`."""
    if cls.__module__.startswith("keras.src"):
        for namespace in ("keras", "keras.callbacks", "keras.layers", "keras.optimizers"):
            module = importlib.import_module(namespace)
            if getattr(module, cls.__name__, None) is cls:
                return f"{namespace}.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


@contextlib.contextmanager
def _columns(width):
    """argparse wraps help to the terminal width: fix it while formatting."""
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width)
    try:
        yield
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old


def command_help():
    """`{command: --help text}` for `keras-dp` and each of `COMMANDS`."""
    from keras_dp import cli

    parser = cli.build_parser()
    subparsers = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            subparsers.update(action.choices)
    helps = {}
    with _columns(80):
        helps["keras-dp"] = parser.format_help()
        for command in COMMANDS:
            helps[f"keras-dp {command}"] = subparsers[command].format_help()
    ansi = re.compile(r"\x1b\[[0-9;]*m")
    return {name: ansi.sub("", text).rstrip() for name, text in helps.items()}


def render_top_level():
    import keras_dp

    lines = [
        "## `keras_dp`",
        "",
        first_paragraph(doc(keras_dp)),
        "",
        "`import keras_dp` exports:",
        "",
    ]
    for name in getattr(keras_dp, "__all__", None) or top_level_names():
        value = getattr(keras_dp, name)
        if inspect.ismodule(value):
            target = value.__name__
        elif inspect.isclass(value) or inspect.isfunction(value):
            target = f"{value.__module__}.{value.__name__}"
        else:
            lines.append(f"- `keras_dp.{name}`{constant_value(value)}")
            continue
        summary = first_paragraph(doc(value)).split(". ")[0].rstrip(".")
        lines.append(f"- [`keras_dp.{name}`](#{anchor(target)}): {summary}.")
    return lines + [""]


def top_level_names():
    """Without `__all__`: the package's public functions, classes, modules."""
    import keras_dp

    return sorted(
        name for name, value in vars(keras_dp).items()
        if not name.startswith("_")
        and (inspect.isfunction(value) or inspect.isclass(value)
             or (inspect.ismodule(value) and value.__name__.startswith("keras_dp.")))
    )


def render():
    """The text of API.md."""
    modules = module_names()
    cli_heading = "The `keras-dp` command"
    lines = [
        "# keras_dp API reference",
        "",
        f"Every public name of `keras_dp`, rendered from its docstring by "
        f"`{COMMAND}`; do not edit by hand.",
        "",
        "## Contents",
        "",
        "- [`keras_dp`](#keras_dp)",
    ]
    lines += [f"- [`{name}`](#{anchor(name)})" for name in modules]
    lines += [f"- [{cli_heading}](#{anchor(cli_heading)})", ""]
    lines += render_top_level()
    for name in modules:
        lines += render_module(name)
    lines += [f"## {cli_heading}", ""]
    for command, text in command_help().items():
        if command != "keras-dp":
            lines += [f"### `{command}`", ""]
        lines += code_block(text)
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if API.md is stale")
    args = parser.parse_args(argv)
    text = render()
    path = ROOT / "API.md"
    if args.check:
        if not path.exists() or path.read_text() != text:
            print(f"API.md is stale: run {COMMAND}", file=sys.stderr)
            return 1
        return 0
    path.write_text(text)
    print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    # Set before anything imports Keras or JAX: the reference needs no accelerator.
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
