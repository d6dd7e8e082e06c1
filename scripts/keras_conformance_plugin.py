"""pytest plugin for scripts/keras_conformance.py: runs Keras's own tests, plain or through keras_dp.

Loaded with `-p keras_conformance_plugin` into the pytest that runs the test
files extracted from Keras's source distribution (never into this project's
own test run). The environment set by keras_conformance.py selects what it does:

KERAS_CONFORMANCE_MODE
    "plain": Keras's `fit`, `evaluate` and `predict` run as they are.
    "routed": `JAXTrainer.fit`, `.evaluate` and `.predict` (the methods every
    `keras.Model` and every `Trainer`-mixin class of Keras's tests inherit on
    the JAX backend) are replaced by wrappers that make the same call through
    keras_dp's public API: `keras_dp.fit_sharded(model, ...)` and
    `keras_dp.ShardedTrainer(model).evaluate/predict(...)`, with the arguments
    the test passed (bound by Keras's own signature, passed by keyword). There
    is no fallback: whatever keras_dp raises, refusals included, is the test's
    error.
KERAS_CONFORMANCE_LOG
    a JSON-lines file this plugin appends to: a "start" record before each
    test and a "result" record after it (outcome, the error's last line, the
    number of calls routed), so that a run whose process dies (an XLA:CPU
    abort, the per-test watchdog) still leaves the results before it and names
    the test it died in.
KERAS_CONFORMANCE_SKIP
    a file of node ids (one a line) to deselect: the tests a previous,
    crashed attempt already ran.
KERAS_CONFORMANCE_TEST_TIMEOUT
    seconds one test may take; past it faulthandler dumps every thread's
    stack to stderr and ends the process (a hung cross-device collective
    cannot be interrupted from Python).

Calls keras_dp itself makes: a call whose caller is code of keras_dp goes to
Keras's original method, as does the `evaluate` Keras's own `fit` makes for
validation (its caller is Keras's JAX trainer, which runs only when an original
`fit` does). Every other caller (the test, its callbacks, Keras's test helpers)
is routed. Each call keras_dp makes to an original method is logged as an
"internal" record, so the report can say whether keras_dp relies on them.
"""

import faulthandler
import functools
import inspect
import json
import os
import sys
import time

import pytest

MODE = os.environ.get("KERAS_CONFORMANCE_MODE", "plain")
LOG = os.environ.get("KERAS_CONFORMANCE_LOG")
SKIP = os.environ.get("KERAS_CONFORMANCE_SKIP")
TEST_TIMEOUT = float(os.environ.get("KERAS_CONFORMANCE_TEST_TIMEOUT", "0") or 0)

if MODE not in ("plain", "routed"):
    raise RuntimeError(f"KERAS_CONFORMANCE_MODE must be 'plain' or 'routed', not {MODE!r}")

# Set by keras_conformance.py before this process started; checked here, as a
# test that ran on one device or another backend would compare nothing.
assert os.environ.get("KERAS_BACKEND") == "jax", "KERAS_BACKEND must be jax"
assert "--xla_force_host_platform_device_count=" in os.environ.get("XLA_FLAGS", ""), (
    "XLA_FLAGS must simulate the CPU devices before JAX is imported")
assert "jax" not in sys.modules, "JAX was imported before the device count was set"

# After the checks: this imports Keras, and so JAX.
from keras.src.backend.jax.trainer import JAXTrainer  # noqa: E402

_current = {"nodeid": None, "routed": 0}


def _log(record):
    if not LOG:
        return
    with open(LOG, "a", encoding="utf-8") as file:
        file.write(json.dumps(record) + "\n")
        file.flush()


def _caller_module(depth=2):
    frame = sys._getframe(depth)
    return frame.f_globals.get("__name__", "") if frame is not None else ""


# The callers whose calls go to Keras's original methods.
_KERAS_TRAINER = "keras.src.backend.jax.trainer"


def _is_internal(module):
    return module == "keras_dp" or module.startswith("keras_dp.") or module == _KERAS_TRAINER


def _fit(model, arguments):
    import keras_dp

    return keras_dp.fit_sharded(model, **arguments)


def _evaluate(model, arguments):
    import keras_dp

    return keras_dp.ShardedTrainer(model).evaluate(**arguments)


def _predict(model, arguments):
    import keras_dp

    return keras_dp.ShardedTrainer(model).predict(**arguments)


ROUTES = {"fit": _fit, "evaluate": _evaluate, "predict": _predict}


def _routed(name, original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def method(self, *args, **kwargs):
        caller = _caller_module()
        if _is_internal(caller):
            if caller != _KERAS_TRAINER:
                _log({"event": "internal", "nodeid": _current["nodeid"], "method": name,
                      "caller": caller})
            return original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        arguments = dict(bound.arguments)
        del arguments["self"]
        arguments.update(arguments.pop("kwargs", {}))  # evaluate's **kwargs
        _current["routed"] += 1
        return ROUTES[name](self, arguments)

    method.__keras_conformance_original__ = original
    return method


if MODE == "routed":
    for _name in ROUTES:
        setattr(JAXTrainer, _name, _routed(_name, getattr(JAXTrainer, _name)))


def pytest_configure(config):
    # The markers Keras's own conftest.py (in its repository, not in the
    # source distribution) registers; on JAX it skips neither here.
    config.addinivalue_line("markers", "requires_trainable_backend: mark test for trainable backend only")
    config.addinivalue_line("markers", "multi_device: mark test for running with multiple devices only")


def pytest_collection_modifyitems(config, items):
    if not SKIP or not os.path.exists(SKIP):
        return
    with open(SKIP, encoding="utf-8") as file:
        skip = {line.rstrip("\n") for line in file if line.strip()}
    kept = [item for item in items if item.nodeid not in skip]
    config.hook.pytest_deselected(items=[item for item in items if item.nodeid in skip])
    items[:] = kept


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current.update(nodeid=item.nodeid, routed=0, outcome="passed", message="", start=time.time())
    _log({"event": "start", "nodeid": item.nodeid})
    if TEST_TIMEOUT > 0:
        # To the process's own stderr (the mode's .out file: keras_conformance.py
        # runs pytest with --capture=sys, so that what dies with the process,
        # XLA's abort message included, is not lost in a capture file).
        faulthandler.dump_traceback_later(TEST_TIMEOUT, exit=True, file=sys.__stderr__)
    try:
        yield
    finally:
        if TEST_TIMEOUT > 0:
            faulthandler.cancel_dump_traceback_later()
    _log({"event": "result", "nodeid": item.nodeid, "outcome": _current["outcome"],
          "message": _current["message"], "routed_calls": _current["routed"],
          "seconds": round(time.time() - _current["start"], 3)})
    _current["nodeid"] = None


def _last_line(report):
    """The error's own lines: the last block of 'E   ' lines of the traceback, joined by ' | '."""
    if isinstance(report.longrepr, tuple):  # a skip: (path, line, reason)
        return str(report.longrepr[2])[:2000]
    text = str(report.longrepr or "")
    blocks, block = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("E "):
            block.append(line[1:].strip())
        elif block:
            blocks.append(block)
            block = []
    if blocks:
        return " | ".join(line for line in blocks[-1] if line)[:2000]
    lines = text.strip().splitlines()
    return lines[-1][:2000] if lines else ""


def pytest_runtest_logreport(report):
    """Keep the test's outcome: its call's, unless setup or teardown failed (an error)."""
    if report.when == "call":
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
        else:
            outcome = report.outcome
    elif report.failed:
        outcome = "error"
    elif report.skipped and report.when == "setup":
        outcome = "skipped"
    else:
        return
    if _current["outcome"] == "passed":
        _current["outcome"] = outcome
        _current["message"] = "" if outcome in ("passed", "xpassed") else _last_line(report)
