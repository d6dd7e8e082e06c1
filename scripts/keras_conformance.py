#!/usr/bin/env python3
"""Run Keras's own fit tests plain and through keras_dp, and compare.

Fetches the source distribution of the *installed* Keras from the package
index (`pip download keras==<version> --no-deps --no-binary :all:`, kept in a
cache directory; `--sdist PATH` uses a local copy instead), extracts
`keras/src/trainers/trainer_test.py` and 11 callback test files, and runs them
twice with pytest, each in a subprocess on N simulated CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=N, KERAS_BACKEND=jax),
importing the installed keras (only the test files come from the sdist):

plain   Keras's `fit`, `evaluate` and `predict` as they are;
routed  the same tests with those methods routed through keras_dp's public
        API (`keras_dp.fit_sharded`, `keras_dp.ShardedTrainer(...).evaluate`
        and `.predict`), with no fallback to Keras (see
        scripts/keras_conformance_plugin.py for how).

A test that passes plain and does not pass routed is a difference; the ones
tests/keras_conformance_allowed.txt lists (each with its reason) are allowed.
Exit status: 0 no other difference; 1 differences; 2 the run was incomplete
(a mode ran out of time, a file failed to collect); 3 no sdist could be had.

    python scripts/keras_conformance.py                 # both modes: ~13 minutes on 2 loaded cores
    python scripts/keras_conformance.py --json out.json # and every test's result
    python scripts/keras_conformance.py --sdist keras-3.15.1.tar.gz -k early_stopping

The pytest test tests/test_keras_conformance.py (marked slow) runs this script:
`pytest tests/test_keras_conformance.py --runslow`.
"""

import argparse
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import platform
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
PLUGIN = HERE / "keras_conformance_plugin.py"
DEFAULT_ALLOWED = ROOT / "tests" / "keras_conformance_allowed.txt"

CALLBACK_TESTS = (
    "backup_and_restore", "callback", "csv_logger", "early_stopping", "lambda_callback",
    "learning_rate_scheduler", "model_checkpoint", "monitor_callback", "reduce_lr_on_plateau",
    "swap_ema_weights", "terminate_on_nan",
)
TEST_FILES = ("keras/src/trainers/trainer_test.py",) + tuple(
    f"keras/src/callbacks/{name}_test.py" for name in CALLBACK_TESTS)

EXIT_OK, EXIT_DIFFERENCES, EXIT_INCOMPLETE, EXIT_NO_SDIST = 0, 1, 2, 3
MODES = ("plain", "routed")


class NoSdist(Exception):
    """The source distribution could not be found nor downloaded."""


def default_cache_dir():
    if os.environ.get("KERAS_DP_CONFORMANCE_CACHE"):
        return pathlib.Path(os.environ["KERAS_DP_CONFORMANCE_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "keras_dp" / "keras_conformance"


def installed_keras_version():
    return importlib.metadata.version("keras")


def sdist_version(path):
    """The Version: line of the sdist's PKG-INFO."""
    with tarfile.open(path) as archive:
        for member in archive.getmembers():
            if member.name.count("/") == 1 and member.name.endswith("/PKG-INFO"):
                text = archive.extractfile(member).read().decode("utf-8", "replace")
                match = re.search(r"^Version:\s*(\S+)", text, re.M)
                return match.group(1) if match else None
    return None


def fetch_sdist(version, cache_dir, timeout=600):
    """The cached sdist of keras==version, downloaded from the package index if absent."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    cached = cache_dir / f"keras-{version}.tar.gz"
    if cached.is_file():
        return cached
    with tempfile.TemporaryDirectory(prefix="keras_sdist_", dir=cache_dir) as tmp:
        command = [sys.executable, "-m", "pip", "download", f"keras=={version}", "--no-deps",
                   "--no-binary", ":all:", "--disable-pip-version-check", "-d", tmp]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise NoSdist(f"`{' '.join(command)}` took over {timeout} s") from None
        found = sorted(pathlib.Path(tmp).glob("keras-*.tar.gz"))
        if done.returncode != 0 or not found:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-5:])
            raise NoSdist(f"`{' '.join(command)}` failed (status {done.returncode}):\n{tail}")
        os.replace(found[0], cached)  # atomic: a concurrent run sees the whole file or none
    return cached


def extract(sdist, tree):
    """Write the test files and a pytest.ini with Keras's own pytest settings under `tree`."""
    with tarfile.open(sdist) as archive:
        names = {member.name.split("/", 1)[1]: member for member in archive.getmembers()
                 if "/" in member.name and member.isfile()}
        missing = [name for name in TEST_FILES if name not in names]
        if missing:
            raise SystemExit(f"{sdist} lacks {', '.join(missing)}")
        for name in TEST_FILES:
            target = tree / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(archive.extractfile(names[name]).read())
        pyproject = archive.extractfile(names["pyproject.toml"]).read().decode("utf-8")
    # Keras's pytest settings (its pyproject.toml): warnings are errors, but
    # for the kinds it ignores. No __init__.py is written, so the test modules
    # import by their file names and `keras` stays the installed package.
    filters = pytest_filterwarnings(pyproject)
    ini = ["[pytest]", "filterwarnings ="] + [f"    {line}" for line in filters]
    (tree / "pytest.ini").write_text("\n".join(ini) + "\n", encoding="utf-8")


def pytest_filterwarnings(pyproject):
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = None
    if tomllib is not None:
        options = tomllib.loads(pyproject).get("tool", {}).get("pytest", {}).get("ini_options", {})
        return list(options.get("filterwarnings", []))
    block = re.search(r"filterwarnings\s*=\s*\[(.*?)\]", pyproject, re.S)
    return re.findall(r'"([^"]*)"', block.group(1)) if block else []


def subprocess_env(mode, devices, log, skip, test_timeout, plugin_dir):
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    env["KERAS_BACKEND"] = "jax"
    env["JAX_PLATFORMS"] = "cpu"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # The same environment in both modes: no persistent compilation cache
    # (keras_dp would otherwise turn one on in the user's home), and only the
    # plugin, not the pytest plugins this environment has installed.
    env["KERAS_DP_COMPILATION_CACHE"] = "0"
    for name in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                 "PYTEST_ADDOPTS", "PYTEST_PLUGINS"):
        env.pop(name, None)
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(
        [str(plugin_dir)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["KERAS_CONFORMANCE_MODE"] = mode
    env["KERAS_CONFORMANCE_LOG"] = str(log)
    env["KERAS_CONFORMANCE_SKIP"] = str(skip)
    env["KERAS_CONFORMANCE_TEST_TIMEOUT"] = str(test_timeout)
    return env


def read_log(path):
    records = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                pass  # a line cut short by a dying process
    return records


def crash_message(returncode, output):
    """Why a pytest process ended in the middle of a test."""
    if re.search(r"^Timeout \(\d+:\d\d:\d\d\)!$", output, re.M):
        return "timeout: the per-test watchdog ended the process (stacks in the mode's .out file)"
    for pattern in (r"\S*rendezvous.*", r"Fatal Python error.*", r"Check failed.*", r"Aborted.*"):
        match = re.search(pattern, output)
        if match:
            return f"crashed (status {returncode}): {match.group(0).strip()[:300]}"
    return f"crashed (status {returncode})"


def run_mode(mode, tree, work, *, devices, time_limit, test_timeout, keyword, quiet):
    """Run the test files under `mode`; every test's record, and whether the run was complete."""
    results, internal, problems = {}, [], []
    deadline = time.monotonic() + time_limit
    output_path = work / f"{mode}.out"
    output_path.write_text("")
    skip = work / f"{mode}.skip"
    skip.write_text("")
    plugin_dir = work / "plugin"
    for attempt in range(1, 100):
        log = work / f"{mode}.{attempt}.jsonl"
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                   "-p", "keras_conformance_plugin", "-c", str(tree / "pytest.ini"),
                   "--rootdir", str(tree), "-q", "-rN", "--no-header", "-o", "console_output_style=classic",
                   # sys.stdout and sys.stderr captured per test, but not file
                   # descriptors 1 and 2: what a dying process writes there
                   # (XLA's abort, the watchdog's stacks) reaches the .out file.
                   "--capture=sys"]
        if keyword:
            command += ["-k", keyword]
        command += TEST_FILES
        env = subprocess_env(mode, devices, log, skip, test_timeout, plugin_dir)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            problems.append(f"{mode}: the run's time limit ({time_limit} s) was reached")
            break
        with open(output_path, "a", encoding="utf-8") as out:
            out.write(f"\n===== attempt {attempt}: {' '.join(command)}\n")
            out.flush()
            process = subprocess.Popen(command, cwd=tree, env=env, stdout=out,
                                       stderr=subprocess.STDOUT, start_new_session=True)
            try:
                returncode = process.wait(timeout=remaining)
                timed_out = False
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                returncode = process.wait()
                timed_out = True
        records = read_log(log)
        started = None
        for record in records:
            if record["event"] == "start":
                started = record["nodeid"]
            elif record["event"] == "result":
                results[record["nodeid"]] = {k: record[k] for k in
                                             ("outcome", "message", "routed_calls", "seconds")}
                started = None
            elif record["event"] == "internal":
                internal.append(record)
        text = output_path.read_text(encoding="utf-8", errors="replace")
        attempt_output = text[text.rfind("===== attempt"):]
        if timed_out:
            if started:
                results[started] = {"outcome": "timeout", "routed_calls": None, "seconds": None,
                                    "message": f"the mode's time limit ({time_limit} s) ended the run here"}
            problems.append(f"{mode}: the run's time limit ({time_limit} s) was reached")
            break
        if started is None:
            if returncode not in (0, 1, 5):  # 2: interrupted or collection errors; 3, 4: pytest's own
                problems.append(f"{mode}: pytest ended with status {returncode} "
                                f"(see {output_path}):\n{attempt_output[-2000:]}")
            break
        # The process died inside `started`: record it and go on without it.
        message = crash_message(returncode, attempt_output)
        results[started] = {"outcome": "timeout" if message.startswith("timeout") else "crashed",
                            "message": message, "routed_calls": None, "seconds": None}
        if not quiet:
            print(f"  {mode}: {started}: {message}; restarting without the tests run so far",
                  flush=True)
        skip.write_text("".join(f"{nodeid}\n" for nodeid in results))
    return results, internal, problems


def load_allowed(path):
    """[(pattern, regex, reason)] from `path`'s lines `<pattern>[ ~ <regex>] # <reason>`.

    `pattern` is a node id, or a prefix of node ids ending in '*'; with a
    regex, the difference is allowed only when the routed error's message
    matches it (re.search), so that an entry allowing one failure (an
    assertion on Keras's internals) does not also hide another (a refusal).
    """
    entries = []
    if not path or not path.is_file():
        return entries
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pattern, sep, reason = line.partition(" # ")
        if not sep or not reason.strip():
            raise SystemExit(f"{path}:{number}: an entry needs its reason: '<node id> # <reason>'")
        pattern, tilde, regex = pattern.partition(" ~ ")
        try:
            compiled = re.compile(regex.strip()) if tilde else None
        except re.error as error:
            raise SystemExit(f"{path}:{number}: bad regex {regex.strip()!r}: {error}") from None
        entries.append((pattern.strip(), compiled, reason.strip()))
    return entries


def entry_matches(entry, nodeid, message=""):
    pattern, regex, _ = entry
    named = nodeid == pattern or pattern.endswith("*") and nodeid.startswith(pattern[:-1])
    return named and (regex is None or regex.search(message or "") is not None)


def allowed_reason(nodeid, message, allowed):
    """The reason of the first entry allowing `nodeid` to fail routed with `message`, else None."""
    for entry in allowed:
        if entry_matches(entry, nodeid, message):
            return entry[2]
    return None


def error_kind(outcome):
    """A failure's kind, for grouping: its outcome and its message's first line, numbers and
    type names left out (so that one refusal of many classes, or one assertion on many counts,
    is one group)."""
    message = (outcome.get("message") or "").split(" | ")[0]
    message = re.sub(r"of type \S+?\.(?=\s|$)", "of type <type>.", message)
    message = re.sub(r"\d+(\.\d+)?", "<n>", message)
    return f"{outcome['outcome']}: {message[:150]}"


def describe_environment(devices):
    def where(name):
        spec = importlib.util.find_spec(name)
        return os.path.dirname(spec.origin) if spec and spec.origin else "?"

    def version(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "?"

    return {"keras": version("keras"), "keras_path": where("keras"),
            "keras_dp": version("keras_dp"), "keras_dp_path": where("keras_dp"),
            "jax": version("jax"), "jaxlib": version("jaxlib"), "python": platform.python_version(),
            "devices": devices, "platform": platform.platform()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sdist", type=pathlib.Path,
                        help="a local keras-<version>.tar.gz (default: the installed version's, "
                             "from the cache or the package index)")
    parser.add_argument("--cache-dir", type=pathlib.Path, default=None,
                        help="where downloaded sdists are kept (default: $KERAS_DP_CONFORMANCE_CACHE "
                             "or ~/.cache/keras_dp/keras_conformance)")
    parser.add_argument("--fetch-only", action="store_true",
                        help="only make sure the sdist is cached; print its path")
    parser.add_argument("--workdir", type=pathlib.Path,
                        help="where the tests are extracted and run (default: a temporary directory, "
                             "removed unless --keep)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary workdir")
    parser.add_argument("--json", type=pathlib.Path, help="write every test's results here")
    parser.add_argument("--allowed", type=pathlib.Path, default=DEFAULT_ALLOWED,
                        help=f"the allowed differences (default: {DEFAULT_ALLOWED.relative_to(ROOT)})")
    parser.add_argument("--modes", default="plain,routed",
                        help="which modes to run (default: plain,routed); a single mode only reports")
    parser.add_argument("--devices", type=int, default=2, help="simulated CPU devices (default 2)")
    parser.add_argument("--time-limit", type=float, default=1800,
                        help="seconds each mode may take in all (default 1800)")
    parser.add_argument("--test-timeout", type=float, default=300,
                        help="seconds one test may take before its process is ended (default 300)")
    parser.add_argument("-k", dest="keyword", help="only the tests pytest's -k selects")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    modes = [mode.strip() for mode in args.modes.split(",") if mode.strip()]
    if not modes or any(mode not in MODES for mode in modes):
        parser.error(f"--modes takes {', '.join(MODES)}")
    started = time.monotonic()

    version = installed_keras_version()
    if args.sdist:
        if not args.sdist.is_file():
            print(f"no such sdist: {args.sdist}", file=sys.stderr)
            return EXIT_NO_SDIST
        sdist = args.sdist
    else:
        try:
            sdist = fetch_sdist(version, args.cache_dir or default_cache_dir())
        except NoSdist as error:
            print(f"keras {version}'s source distribution is not cached and could not be "
                  f"downloaded: {error}", file=sys.stderr)
            return EXIT_NO_SDIST
    if args.fetch_only:
        print(sdist)
        return EXIT_OK
    tested = sdist_version(sdist)
    if tested != version:
        print(f"{sdist} is Keras {tested}, but Keras {version} is installed", file=sys.stderr)
        return EXIT_INCOMPLETE
    environment = describe_environment(args.devices)
    print(f"Keras {version} at {environment['keras_path']} (tests from {sdist})\n"
          f"keras_dp {environment['keras_dp']} at {environment['keras_dp_path']}; "
          f"JAX {environment['jax']}; {args.devices} simulated CPU devices", flush=True)

    work = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="keras_conformance_"))
    if args.workdir:
        if work.exists():
            shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    try:
        tree = work / "tree"
        extract(sdist, tree)
        (work / "plugin").mkdir()
        shutil.copy(PLUGIN, work / "plugin" / PLUGIN.name)
        results, internal, problems, seconds = {}, {}, [], {}
        for mode in modes:
            mode_start = time.monotonic()
            results[mode], internal[mode], mode_problems = run_mode(
                mode, tree, work, devices=args.devices, time_limit=args.time_limit,
                test_timeout=args.test_timeout, keyword=args.keyword, quiet=args.quiet)
            problems += mode_problems
            seconds[mode] = round(time.monotonic() - mode_start, 1)
            passed = sum(r["outcome"] == "passed" for r in results[mode].values())
            print(f"{mode}: {passed} of {len(results[mode])} passed in {seconds[mode]:.0f} s",
                  flush=True)
        status = report(args, modes, results, internal, problems, seconds, environment, sdist,
                        time.monotonic() - started)
        return status
    finally:
        if not args.workdir and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        elif args.keep or args.workdir:
            print(f"work directory: {work}")


def report(args, modes, results, internal, problems, seconds, environment, sdist, elapsed):
    allowed = load_allowed(args.allowed)
    nodeids = sorted(set().union(*(results[mode] for mode in modes)))
    status = EXIT_INCOMPLETE if problems else EXIT_OK
    differences, allowed_differences, stale = [], [], []
    counts = {f"{mode}_{outcome}": 0 for mode in modes for outcome in ("passed", "total")}
    for mode in modes:
        counts[f"{mode}_total"] = len(results[mode])
        counts[f"{mode}_passed"] = sum(r["outcome"] == "passed" for r in results[mode].values())
    if modes == list(MODES):
        plain, routed = results["plain"], results["routed"]
        for nodeid in nodeids:
            if plain.get(nodeid, {}).get("outcome") != "passed":
                continue
            outcome = routed.get(nodeid, {"outcome": "missing", "message": "not run routed"})
            if outcome["outcome"] == "passed":
                continue
            reason = allowed_reason(nodeid, outcome.get("message", ""), allowed)
            (allowed_differences if reason else differences).append((nodeid, outcome, reason))
        stale = [entry[0] for entry in allowed
                 if not any(entry_matches(entry, nodeid, outcome.get("message", ""))
                            for nodeid, outcome, _ in allowed_differences)]
        counts.update(differences=len(differences), allowed_differences=len(allowed_differences))
        not_passing = [n for n in nodeids if plain.get(n, {}).get("outcome") not in (None, "passed")]
        skipped = [n for n in not_passing if plain[n]["outcome"] == "skipped"]
        if not_passing:
            print(f"\nNot compared: {len(skipped)} test(s) skipped under plain Keras (on JAX), and "
                  f"{len(not_passing) - len(skipped)} that do not pass under plain Keras here:")
            for nodeid in not_passing:
                if nodeid not in skipped:
                    print(f"  {nodeid}: {plain[nodeid]['outcome']}: {plain[nodeid]['message'][:200]}")
        if allowed_differences:
            print(f"\n{len(allowed_differences)} allowed difference(s) "
                  f"({args.allowed.name if args.allowed else ''}):")
            for nodeid, outcome, reason in allowed_differences:
                print(f"  {nodeid}: {outcome['outcome']} ({reason})")
        if stale:
            print(f"\n{len(stale)} allowed entr(ies) match no difference now (fixed, or failing "
                  "another way, or not run); remove the fixed ones:")
            for pattern in stale:
                print(f"  {pattern}")
        if differences:
            print(f"\n{len(differences)} test(s) pass with plain Keras but not through keras_dp, "
                  "grouped by error:")
            groups = {}
            for nodeid, outcome, _ in differences:
                groups.setdefault(error_kind(outcome), []).append((nodeid, outcome))
            for kind, members in sorted(groups.items(), key=lambda item: -len(item[1])):
                print(f"\n  {len(members)} x {kind}")
                for nodeid, outcome in members:
                    print(f"    {nodeid}: {outcome.get('message', '')[:300]}")
            if status == EXIT_OK:
                status = EXIT_DIFFERENCES
        calls = {}
        for record in internal.get("routed", []):
            key = f"{record['caller']} -> {record['method']}"
            calls[key] = calls.get(key, 0) + 1
        if calls:
            print("\nkeras_dp called Keras's own methods (not routed): "
                  + ", ".join(f"{key} x{count}" for key, count in sorted(calls.items())))
    for problem in problems:
        print(f"\nINCOMPLETE: {problem}")
    summary = (f"\nKeras {environment['keras']}: " + ", ".join(
        f"{mode} {counts[f'{mode}_passed']}/{counts[f'{mode}_total']} passed" for mode in modes))
    if modes == list(MODES):
        summary += (f"; {len(differences)} unexpected and {len(allowed_differences)} allowed "
                    "difference(s)")
    print(summary + f"; {elapsed:.0f} s")
    if args.json:
        document = {
            "environment": environment, "sdist": str(sdist), "counts": counts,
            "seconds": seconds, "problems": problems, "status": status,
            "differences": [n for n, _, _ in differences],
            "allowed_differences": {n: r for n, _, r in allowed_differences},
            "stale_allowed": stale,
            "internal_calls": internal,
            "tests": {nodeid: {mode: results[mode].get(nodeid) for mode in modes}
                      for nodeid in nodeids},
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    return status


if __name__ == "__main__":
    sys.exit(main())
