"""Write API.md, the API reference, from the package's docstrings.

    python scripts/make_api_doc.py          # rewrite API.md
    python scripts/make_api_doc.py --check  # exit 1 if API.md is stale

tests/test_api_doc.py runs the check, so the reference cannot drift from
the code.
"""

import argparse
import importlib
import inspect
import os
import pathlib
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["COLUMNS"] = "80"  # argparse wraps help text to the terminal: fix it

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Most used first; then the parts, in the order the trainer uses them.
MODULES = [
    "keras_dp.fit", "keras_dp.trainer", "keras_dp.ensemble", "keras_dp.checkpoint",
    "keras_dp.distributed", "keras_dp.models", "keras_dp.datasets", "keras_dp.mesh",
    "keras_dp.state", "keras_dp.step", "keras_dp.data", "keras_dp.build",
    "keras_dp.callbacks", "keras_dp.inflight", "keras_dp.describe", "keras_dp.plots",
    "keras_dp.members", "keras_dp.ensemble_step", "keras_dp.scores", "keras_dp.launch",
    "keras_dp.cli",
]


def public_members(module):
    """The public functions and classes defined in `module`, in source order."""
    members = [
        (name, value) for name, value in vars(module).items()
        if not name.startswith("_")
        and (inspect.isfunction(value) or inspect.isclass(value))
        and value.__module__ == module.__name__
    ]
    return sorted(members, key=lambda item: inspect.getsourcelines(item[1])[1])


def class_members(cls):
    members = []
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(value, (classmethod, staticmethod)):
            value = value.__func__
        if inspect.isfunction(value) or isinstance(value, property):
            members.append((name, value))
    return members


def signature(obj):
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"


def doc(obj):
    return inspect.getdoc(obj) or ""


def render_entry(lines, title, obj):
    lines.append(f"### `{title}`\n")
    text = doc(obj)
    lines.append(text + "\n" if text else "_(no docstring)_\n")


def render():
    import keras_dp
    from keras_dp import cli

    lines = [
        "# keras_dp API reference",
        "",
        "Generated from the docstrings by `python scripts/make_api_doc.py`; do "
        "not edit by hand. `import keras_dp` exports: "
        + ", ".join(f"`{name}`" for name in keras_dp.__all__) + ".",
        "",
        "## Contents",
        "",
    ]
    lines += [f"- [`{name}`](#{name.replace('.', '')})" for name in MODULES]
    lines += ["- [The `keras-dp` command](#the-keras-dp-command)", ""]
    for name in MODULES:
        module = importlib.import_module(name)
        lines.append(f"## {name}\n")
        lines.append(doc(module).split("\n\n")[0] + "\n")
        for member_name, value in public_members(module):
            if inspect.isclass(value):
                render_entry(lines, f"{member_name}{signature(value)}", value)
                for attr, member in class_members(value):
                    if isinstance(member, property):
                        render_entry(lines, f"{member_name}.{attr}", member)
                    else:
                        render_entry(lines, f"{member_name}.{attr}{signature(member)}", member)
            else:
                render_entry(lines, f"{member_name}{signature(value)}", value)
    lines.append("## The `keras-dp` command\n")
    parser = cli.build_parser()
    lines.append("```\n" + parser.format_help().rstrip() + "\n```\n")
    for action in parser._subparsers._group_actions if parser._subparsers else []:
        for command, subparser in action.choices.items():
            lines.append(f"### `keras-dp {command}`\n")
            lines.append("```\n" + subparser.format_help().rstrip() + "\n```\n")
    return "\n".join(lines).rstrip() + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if API.md is stale")
    args = parser.parse_args()
    text = render()
    path = ROOT / "API.md"
    if args.check:
        if not path.exists() or path.read_text() != text:
            print("API.md is stale: run python scripts/make_api_doc.py", file=sys.stderr)
            return 1
        return 0
    path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
