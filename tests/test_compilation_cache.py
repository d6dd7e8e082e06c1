"""JAX's persistent compilation cache (`keras_dp.diagnostics.compilation_cache`): a rerun loads its steps."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from keras_dp.diagnostics import compilation_cache

ROOT = pathlib.Path(__file__).resolve().parents[1]
# One small fit on 2 devices; prints the cache directory in use and the
# programs JAX found in (hits) or compiled for (misses) the persistent cache.
# keras.utils.set_random_seed imports TensorFlow when it can (4 to 8 s a
# process on the 2-core VM); this fit has no use for it, so it stays out.
SCRIPT = """
import json, logging, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
sys.modules["tensorflow"] = None
import jax, keras, numpy as np
import keras_dp

messages = []
handler = logging.Handler()
handler.emit = lambda record: messages.append(record.getMessage())
logger = logging.getLogger("jax._src.compiler")
logger.setLevel(logging.DEBUG)
logger.addHandler(handler)
if os.environ.get("EARLY"):  # as `keras-dp train` does
    import keras_dp.diagnostics.compilation_cache
    keras_dp.diagnostics.compilation_cache.enable(min_compile_time_s=0)
    messages.append("EARLY ENABLED")
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
model.compile(optimizer="sgd", loss="mse")
trainer = keras_dp.ShardedTrainer(model)
trainer.fit(np.ones((16, 8), "float32"), np.zeros((16, 4), "float32"), batch_size=8, verbose=0)
named = lambda start: [m.split("'")[1] for m in messages if m.startswith(start)]
before = messages[:messages.index("EARLY ENABLED") + 1] if "EARLY ENABLED" in messages else []
print(json.dumps({"dir": trainer.compilation_cache_dir,
                  "hits": named("Persistent compilation cache hit"),
                  "misses": named("PERSISTENT COMPILATION CACHE MISS"),
                  "min_compile_time": jax.config.jax_persistent_cache_min_compile_time_secs}))
"""


def run_fit(tmp_path, **env):
    environ = {key: value for key, value in os.environ.items()
               if key not in ("XLA_FLAGS", compilation_cache.ENV, "JAX_COMPILATION_CACHE_DIR")}
    # Cache every program, however fast it compiles, and keep the real home clean.
    environ.update(HOME=str(tmp_path / "home"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   PYTHONPATH=str(ROOT))
    environ.update(env)
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=environ, capture_output=True,
                            text=True, timeout=240, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_the_train_step_from_the_per_user_cache(tmp_path):
    xdg = tmp_path / "xdg"
    first = run_fit(tmp_path, XDG_CACHE_HOME=str(xdg))
    cache = xdg / "keras_dp" / "jax"
    assert first["dir"] == str(cache)
    assert "jit_train_step" in first["misses"] and "jit_train_step" not in first["hits"]
    assert any(cache.iterdir())
    second = run_fit(tmp_path, XDG_CACHE_HOME=str(xdg))
    assert "jit_train_step" in second["hits"] and "jit_train_step" not in second["misses"]


@pytest.mark.slow  # two more processes; the first test checks the cache in CI
def test_enabled_before_the_model_the_cache_holds_its_initializers_too(tmp_path):
    # The argument's threshold (0 s) replaces the environment's (here 60 s,
    # which would cache nothing).
    xdg = tmp_path / "xdg"
    slow = dict(XDG_CACHE_HOME=str(xdg), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="60")
    first = run_fit(tmp_path, EARLY="1", **slow)
    assert first["min_compile_time"] == 0
    second = run_fit(tmp_path, EARLY="1", **slow)
    assert "jit_train_step" in second["hits"]
    initializers = [name for name in second["hits"] if name != "jit_train_step"]
    assert initializers, second


@pytest.mark.slow  # a process; the argument-order test checks the switch in CI
def test_the_environment_variable_turns_the_cache_off(tmp_path):
    xdg = tmp_path / "xdg"
    off = run_fit(tmp_path, XDG_CACHE_HOME=str(xdg), **{compilation_cache.ENV: "0"})
    # JAX still looks programs up (and logs misses), in no directory at all.
    assert off["dir"] is None and off["hits"] == []
    assert not (xdg / "keras_dp").exists() and not (tmp_path / "home" / ".cache").exists()


def test_the_argument_then_the_environment_then_jax_then_the_default_decide():
    choose = compilation_cache.choose_dir
    home = {"XDG_CACHE_HOME": "/xdg"}
    assert choose(True, home, None) == os.path.join("/xdg", "keras_dp", "jax")
    assert choose(False, home, None) is None
    assert choose("/mine", {compilation_cache.ENV: "0"}, "/theirs") == "/mine"
    assert choose(pathlib.Path("/mine"), {}, None) == "/mine"
    for off in ("0", "false", "OFF", "no"):
        assert choose(True, {compilation_cache.ENV: off}, None) is None
    assert choose(True, {compilation_cache.ENV: "/env"}, None) == "/env"
    assert choose(True, {compilation_cache.ENV: "/env"}, "/user") is None  # the user's is kept
    assert choose(True, {}, "/user") is None
    with pytest.raises(ValueError, match="True .*False .*or a directory. Received: "
                                         "compilation_cache=3"):
        choose(3, {}, None)


@pytest.mark.slow
def test_a_cache_directory_under_home_is_expanded_not_made_literally(tmp_path):
    # Before, "~/jax cache" (the argument or the environment variable) reached
    # JAX as is, and JAX wrote its cache into a directory named "~" under the
    # working directory (checkpoint_dir and profile_dir expand it).
    result = run_fit(tmp_path, **{compilation_cache.ENV: "~/jax cache"})
    cache = tmp_path / "home" / "jax cache"
    assert result["dir"] == str(cache)
    assert any(cache.iterdir())
    assert not (tmp_path / "~").exists()
    assert compilation_cache.choose_dir("~/mine", {}, None) == os.path.expanduser("~/mine")


@pytest.mark.slow  # two runs of keras-dp train
def test_a_second_keras_dp_train_loads_what_the_first_compiled(tmp_path):
    # benchmarks/compile_cache.py --cli, once cold and once warm, on 512 images.
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import compile_cache as bench
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    cache = str(tmp_path / "cache")
    _, cold = bench.run_once(cache, 2, 64, True, ["--train-samples", "512"])
    entries = len(os.listdir(cache))
    _, warm = bench.run_once(cache, 2, 64, True, ["--train-samples", "512"])
    # The first run cached what took 0.1 s or more to compile (the CLI's
    # threshold) and loaded nothing; the second loads those and compiles
    # only the rest. (Counted at the first step's end, while the other
    # programs compile ahead: either run may not have finished them all.)
    assert cold["loaded"] == 0 and entries >= 1, (cold, entries)
    assert 1 <= warm["loaded"] <= entries, (cold, warm, entries)
    assert warm["compiled"] + warm["loaded"] <= cold["compiled"] + 1, (cold, warm, entries)
    assert warm["compiled"] < cold["compiled"], (cold, warm, entries)
    assert all(warm[phase] > 0 for phase in ("imports", "to_first_step_end"))
