"""Compilation you pay once: JAX's persistent compilation cache, on by default.

Making a trainer (`ShardedTrainer`, `fit_sharded`) points JAX's persistent
compilation cache (`jax_compilation_cache_dir`) at a per-user directory,
`$XDG_CACHE_HOME/keras_dp/jax` (`~/.cache/keras_dp/jax` when
`XDG_CACHE_HOME` is unset), so that a second run of the same program on the
same devices loads its compiled steps from disk instead of compiling them.
It is set when a trainer is made, never on import, and only in these cases:

- `compilation_cache=False` (the trainer's argument) leaves JAX's setting
  as it is;
- `compilation_cache="some/dir"` uses that directory;
- otherwise the environment variable `KERAS_DP_COMPILATION_CACHE` decides:
  `0`, `false`, `off` or `no` leave JAX's setting as it is; a path is used
  as the directory;
- and a directory the user set already (`jax.config.update(
  "jax_compilation_cache_dir", ...)` or `JAX_COMPILATION_CACHE_DIR`) is
  kept.

JAX caches only programs that took at least
`jax_persistent_cache_min_compile_time_secs` (1 s by default) to compile
and are at least `jax_persistent_cache_min_entry_size_bytes` (0) large;
keras_dp leaves both as they are, so the train steps that take seconds to
compile are stored and Keras's many tiny eager programs are not. Turning the
cache off again within a process that has used it is not possible in JAX:
`False` only means keras_dp does not touch it.
"""

import os

import jax

ENV = "KERAS_DP_COMPILATION_CACHE"
OFF = frozenset({"0", "false", "off", "no"})


def default_dir(environ):
    """The per-user cache directory: `$XDG_CACHE_HOME/keras_dp/jax`, else `~/.cache/keras_dp/jax`."""
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "keras_dp", "jax")


def choose_dir(compilation_cache, environ, current):
    """The directory keras_dp should set, or `None` to leave JAX's setting alone.

    Args:
        compilation_cache: the trainer's argument: `True` (the default),
            `False`, or a directory.
        environ: the environment (for `KERAS_DP_COMPILATION_CACHE` and
            `XDG_CACHE_HOME`).
        current: JAX's `jax_compilation_cache_dir` now (`None` if unset).

    Raises:
        ValueError: `compilation_cache` is not a bool or a path.
    """
    if compilation_cache is False:
        return None
    if compilation_cache is not True:
        if not isinstance(compilation_cache, (str, os.PathLike)) or not str(compilation_cache):
            raise ValueError(
                "`compilation_cache` is True (a per-user directory, the "
                "default), False (leave JAX's cache setting alone) or a "
                f"directory. Received: compilation_cache={compilation_cache!r}."
            )
        return os.path.expanduser(os.fspath(compilation_cache))
    setting = environ.get(ENV, "").strip()
    if setting.lower() in OFF or current:
        return None
    # JAX takes "~" literally; checkpoint_dir and profile_dir expand it too.
    return os.path.expanduser(setting) if setting else default_dir(environ)


def enable(compilation_cache=True, min_compile_time_s=None):
    """Point JAX's persistent compilation cache at keras_dp's choice; return the directory in use.

    See the module doc for the choice. Returns `jax_compilation_cache_dir`
    after the call (`None`: no persistent cache). Call it before building
    a model to have the model's initializers cached too (as `keras-dp
    train` does); a trainer calls it again, which changes nothing then.

    Args:
        compilation_cache: `True`, `False` or a directory, as for
            `ShardedTrainer`.
        min_compile_time_s: if given and a cache is in use, cache programs
            that took at least this long to compile
            (`jax_persistent_cache_min_compile_time_secs`, 1 s by default).
            Random initializers of a model's weights compile for a fraction
            of a second each on CPU, below JAX's default.
    """
    current = jax.config.jax_compilation_cache_dir
    path = choose_dir(compilation_cache, os.environ, current)
    if path is not None and path != current:
        if current:
            # JAX opens its cache once; a new directory needs a fresh start.
            from jax.experimental.compilation_cache import (
                compilation_cache as jax_cache,
            )

            jax_cache.reset_cache()
        jax.config.update("jax_compilation_cache_dir", path)
    if min_compile_time_s is not None and jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_time_s)
    return jax.config.jax_compilation_cache_dir
