"""`keras-dp launch`: P processes on this machine, joined as if on P hosts.

For trying multi-process training without a cluster: every child gets the
`KERAS_DP_*` variables that `keras_dp.distributed.initialize()` reads, with
a free loopback port for the coordinator, and optionally its own simulated
CPU devices. Children's output is streamed, each line prefixed with
`[process i]`. If any child fails, the others are stopped, and the launcher
fails with the first failing child's exit status. A SIGTERM to the launcher
(a scheduler's preemption, `kill`, a container stopping) goes on to every
child, which saves and exits as a fit does on SIGTERM (status 143), and the
launcher waits for them all.
"""

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

from keras_dp.cli import defaults
from keras_dp import distributed
from keras_dp import liveness
from keras_dp.checkpoint import preemption

# Commands of keras-dp itself; anything else after `--` runs as a program.
KERAS_DP_COMMANDS = ("train",)
# What a process that ends for SIGTERM exits with (128 + 15), as a fit does.
SIGTERM_STATUS = 128 + signal.SIGTERM
# What the launcher exits with after Ctrl-C (128 + 2), as a shell reports one that SIGINT ended.
SIGINT_STATUS = 128 + signal.SIGINT


def launch(command, processes, cpu_devices=None, port=None, grace_seconds=5.0):
    """Run `command` as `processes` joined processes and wait for all of them.

    Args:
        command: a keras-dp command line (`["train", "--epochs", "1"]`), or
            any program and its arguments (`["python", "my_training.py"]`).
        processes: how many processes to start.
        cpu_devices: give each process this many simulated CPU devices (sets
            `XLA_FLAGS` and `JAX_PLATFORMS=cpu` in its environment).
        port: the coordinator's port on 127.0.0.1 (default: a free one).
        grace_seconds: how long stopped children get to exit before they
            are killed.

    Returns:
        0 when every process succeeded, else the exit status of the first
        that failed (1 when it was killed by a signal); 130 after Ctrl-C
        (the processes still running are stopped). After a SIGTERM to
        the launcher, which each child gets too: 143 when the children
        ended for it (exited 143, or were ended by the signal) or succeeded.

    Raises:
        ValueError: no command, or fewer than one process.
    """
    if processes < 1:
        raise ValueError(f"--processes must be at least 1. Received: {processes}.")
    command = program(command)
    address = f"127.0.0.1:{port or _free_port()}"
    children = [
        subprocess.Popen(
            command, env=child_environment(index, processes, address, cpu_devices),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
        )
        for index in range(processes)
    ]
    lock = threading.Lock()
    streams = [
        threading.Thread(target=_stream, args=(child, f"[process {index}] ", lock), daemon=True)
        for index, child in enumerate(children)
    ]
    for stream in streams:
        stream.start()
    terminated = threading.Event()

    def forward(signum, frame):  # the children save and exit as they decide: waited for
        terminated.set()
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)

    with preemption.handling_sigterm(forward):
        try:
            status = _wait(children, terminated)
        except KeyboardInterrupt:  # a terminal's Ctrl-C reaches the children too
            print("keras-dp launch: stopped by Ctrl-C; stopping the processes.",
                  file=sys.stderr, flush=True)
            status = SIGINT_STATUS
        finally:
            if not terminated.is_set():  # a child failed: stop the rest
                _stop(children, grace_seconds, _settle_seconds(children))
            for stream in streams:
                stream.join(timeout=grace_seconds)
    return status


def program(command):
    """The command line each child runs: `command`, made runnable.

    A keras-dp command (`train ...`) runs as `python -m keras_dp train ...`
    and a Python file (`script.py ...`) with this Python, the one keras-dp
    runs in; anything else must be a program on `PATH` or an executable file.

    Raises:
        ValueError: no command, or one that cannot be run, with what to pass
            instead. Checked before any child starts: Popen's own
            `PermissionError` or `FileNotFoundError` came from the first
            child, as a traceback.
    """
    if not command:
        raise ValueError(
            "No command to launch. Put it after `--`, for example: "
            "keras-dp launch --processes 2 -- train --epochs 1"
        )
    if command[0] in KERAS_DP_COMMANDS:
        return [sys.executable, "-m", "keras_dp", *command]
    if command[0].endswith(".py"):
        if not os.path.isfile(command[0]):
            raise ValueError(f"No Python file {command[0]!r} to launch (from {os.getcwd()}).")
        return [sys.executable, *command]
    if shutil.which(command[0]) is None:
        raise ValueError(
            f"Cannot launch {command[0]!r}: it is neither a keras-dp command "
            f"({', '.join(KERAS_DP_COMMANDS)}) nor a program on PATH or an executable "
            "file. Pass a Python file (keras-dp launch -- my_training.py) or the "
            "program with its path (keras-dp launch -- python my_training.py).")
    return command


def child_environment(index, processes, address, cpu_devices=None):
    """The environment of child `index`: ours, plus what it needs to join."""
    env = dict(os.environ)
    env[distributed.COORDINATOR_ENV] = address
    env[distributed.NUM_PROCESSES_ENV] = str(processes)
    env[distributed.PROCESS_ID_ENV] = str(index)
    # What the processes say to run again when one of them is lost: this launch.
    env.setdefault(liveness.RESUME_COMMAND_ENV, shlex.join(sys.orig_argv))
    env["PYTHONUNBUFFERED"] = "1"  # lines arrive as they are printed
    if cpu_devices is not None:
        defaults.cpu_device_environment(cpu_devices, env)
    return env


def _wait(children, terminated):
    """Poll until all succeeded (0) or one failed (its status); after a SIGTERM, wait for all.

    Once `terminated` is set, every child's end is waited for: the status
    is the first failure other than the signal's, else 143 if any child
    ended for the signal (143, or killed by it), else 0.
    """
    ended = (0, SIGTERM_STATUS, -signal.SIGTERM)
    while True:
        if terminated.is_set():
            codes = [child.wait() for child in children]
            failed = [code for code in codes if code not in ended]
            if failed:
                return failed[0] if failed[0] > 0 else 1
            return SIGTERM_STATUS if any(code != 0 for code in codes) else 0
        codes = [child.poll() for child in children]
        failed = [code for code in codes if code not in (None, 0)]
        if failed:
            return failed[0] if failed[0] > 0 else 1
        if all(code == 0 for code in codes):
            return 0
        time.sleep(0.1)


def _settle_seconds(children):
    """How long the others may take to end by themselves after a child failed.

    A child killed by a signal (SIGKILL, an out-of-memory kill) said
    nothing: the others learn of it within the heartbeat timeout and end
    with keras_dp's line naming it (`keras_dp.liveness`), which a SIGTERM
    from here would preempt. A child that exited with a status said why.
    """
    killed = any((child.poll() or 0) < 0 for child in children)
    return distributed.heartbeat_timeout_setting() + 10 if killed else 0


def _stop(children, grace_seconds, settle_seconds=0):
    """Terminate the children still running after `settle_seconds`; kill those that do not exit."""
    deadline = time.monotonic() + settle_seconds
    while time.monotonic() < deadline and any(child.poll() is None for child in children):
        time.sleep(0.1)
    running = [child for child in children if child.poll() is None]
    for child in running:
        child.terminate()
    deadline = time.monotonic() + grace_seconds
    for child in running:
        try:
            child.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def _stream(child, prefix, lock):
    for line in child.stdout:
        with lock:
            sys.stdout.write(prefix + line)
            sys.stdout.flush()


def _free_port():
    # The port is free now; a race with another program taking it before the
    # coordinator binds it is possible but rare on a test machine.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
