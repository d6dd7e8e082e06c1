"""Packages and bytes an install of keras_dp (with extras) brings, read from this environment.

    python scripts/install_size.py plot            # README: the main job's install
    python scripts/install_size.py test            # README: the test install
    python scripts/install_size.py --package tensorflow-cpu   # one package and its closure

Starts from keras_dp's requirements with the given extras (or from
`--package`), follows every installed distribution's own requirements
(their markers evaluated for this Python and platform, extras followed),
and adds up the files each one installed (its RECORD, with the `.pyc` files
pip compiles at install), as a fresh virtual environment with the same
versions holds them (pip and setuptools, which the environment brings,
aside). No network: only what is installed here is read, so
run it in an environment where the install was made. Prints the count, the
bytes, the largest distributions and the machine.
"""

import argparse
import importlib.metadata
import os
import pathlib
import platform
import re

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("extras", nargs="*", help="keras_dp extras (tf, grain, plot, test)")
    parser.add_argument("--package", default=None,
                        help="start from this installed distribution instead of keras_dp")
    parser.add_argument("--top", type=int, default=5, help="largest distributions to list")
    return parser.parse_args(argv)


def closure(name, extras=()):
    """Canonical names of `name` and every distribution it needs, installed here."""
    found, queue = {}, [(canonicalize_name(name), frozenset(extras))]
    while queue:
        current, wanted = queue.pop()
        if current in found and wanted <= found[current]:
            continue
        found[current] = found.get(current, frozenset()) | wanted
        for text in importlib.metadata.distribution(current).requires or []:
            requirement = Requirement(text)
            if requirement.marker is not None and not any(
                    requirement.marker.evaluate(default_environment() | {"extra": extra})
                    for extra in (sorted(found[current]) or [""])):
                continue
            queue.append((canonicalize_name(requirement.name), frozenset(requirement.extras)))
    return sorted(found)


def installed_bytes(name):
    """Bytes of the files `name` installed, as its RECORD lists them."""
    distribution = importlib.metadata.distribution(name)
    total = 0
    for file in distribution.files or []:
        path = pathlib.Path(distribution.locate_file(file))
        if path.is_file():
            total += path.stat().st_size
    return total


def main(argv=None):
    args = parse_args(argv)
    start = args.package or "keras_dp"
    names = closure(start, args.extras)
    sizes = {name: installed_bytes(name) for name in names}
    what = start + (f"[{','.join(args.extras)}]" if args.extras else "")
    print(f"{what}: {len(names)} packages ({start} included), "
          f"{sum(sizes.values()) / 1e6:,.0f} MB installed")
    for name, size in sorted(sizes.items(), key=lambda item: -item[1])[: args.top]:
        version = importlib.metadata.version(name)
        print(f"  {name} {version}: {size / 1e6:,.0f} MB")
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores, {platform.system()}, "
          f"Python {platform.python_version()}")


def cpu_model():
    """The CPU's model name from /proc/cpuinfo, as benchmarks/bench.py reads it."""
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown CPU"
    match = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    return match[1] if match else platform.processor() or "unknown CPU"


if __name__ == "__main__":
    main()
