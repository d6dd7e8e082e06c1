"""The CLI's defaults: epochs, and the simulated CPU devices it asks JAX for.

Standard library only, like the parser (`keras_dp.cli`): read by `--help`
and by the commands (`keras_dp.cli.train`, `keras_dp.cli.launch`).
"""

import os

# With no GPU or TPU, `keras-dp train` splits the CPU into this many
# simulated devices, so that a first run shows the data parallelism.
DEFAULT_CPU_DEVICES = 2
# Epochs when --epochs is not given. An epoch of the bundled subset is 79
# steps of 64, and BatchNormalization's moving statistics (momentum 0.99),
# which the test set is scored with, need several hundred steps to follow
# the weights: after 2 such epochs the test accuracy was near chance (0.09).
DEFAULT_EPOCHS = 2
DEFAULT_EPOCHS_ON_THE_SUBSET = 10
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def use_cpu_devices(count):
    """Make JAX start with `count` simulated CPU devices.

    Raises:
        ValueError: `count` is below 1.
        RuntimeError: JAX has already started a backend (too late to change).
    """
    from keras_dp import _compat  # noqa: PLC0415 (imports Keras)

    if count < 1:
        raise ValueError(f"--cpu-devices must be at least 1. Received: {count}.")
    # JAX is always imported here (through Keras); what matters is whether it
    # has started a backend yet.
    if _compat.jax_backend_started():
        raise RuntimeError(
            "JAX has already started, so the number of CPU devices can no "
            "longer change. Set XLA_FLAGS=--xla_force_host_platform_device_count"
            f"={count} before starting Python, or restart the kernel."
        )
    cpu_device_environment(count, environ=os.environ)


def cpu_device_environment(count, environ=None):
    """The environment that makes a new JAX start with `count` CPU devices.

    Edits `XLA_FLAGS` (`--xla_force_host_platform_device_count`, XLA's own
    flag) and sets `JAX_PLATFORMS=cpu`, in `environ` (default: a copy of
    `os.environ`). Returns the edited mapping.
    """
    env = dict(os.environ) if environ is None else environ
    flags = [flag for flag in env.get("XLA_FLAGS", "").split()
             if not flag.startswith(_DEVICE_COUNT_FLAG)]
    env["XLA_FLAGS"] = " ".join(flags + [f"{_DEVICE_COUNT_FLAG}={count}"])
    env["JAX_PLATFORMS"] = "cpu"
    return env


def default_cpu_devices(environ):
    """Ask XLA for `DEFAULT_CPU_DEVICES` CPU devices, unless `XLA_FLAGS` sets a count.

    Only XLA's CPU platform reads the flag: on a machine with a GPU or TPU,
    JAX still trains on those, and the simulated CPU devices go unused.

    Returns:
        Whether the default was applied (the CLI then says so, on CPU).
    """
    flags = environ.get("XLA_FLAGS", "")
    if _DEVICE_COUNT_FLAG in flags:
        return False
    environ["XLA_FLAGS"] = f"{flags} {_DEVICE_COUNT_FLAG}={DEFAULT_CPU_DEVICES}".strip()
    return True
