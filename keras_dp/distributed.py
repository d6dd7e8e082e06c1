"""Many processes: JAX's multi-controller runtime and each process's share.

With one process per host (`initialize` first, then the same program on
every host), JAX sees every host's devices, and keras_dp's mesh spans them
all. Nothing else in the training changes: the state lies on every host's
devices as on one host's (replicated, or split as `state_sharding` says),
each global batch is split along `"batch"`, and XLA's gradient all-reduce
now crosses hosts.

What does change is the input. Each process passes the same whole arrays
(each then takes its part of every global batch, in one global order), or
only its own share of the data (`process_share`), with the global
`batch_size` (`local_batch_size` is each process's part);
`keras_dp.multihost.batches.GlobalBatches` assembles the global batches.
This module holds the runtime and the processes' shares; what happens when a
process is lost is `keras_dp.liveness`'s. Nothing here runs inside a step.
"""

import atexit
import contextlib
import os
import socket
import sys
import threading

import jax

from keras_dp import _compat
from keras_dp import liveness

COORDINATOR_ENV = "KERAS_DP_COORDINATOR"
NUM_PROCESSES_ENV = "KERAS_DP_NUM_PROCESSES"
PROCESS_ID_ENV = "KERAS_DP_PROCESS_ID"
HEARTBEAT_ENV = "KERAS_DP_HEARTBEAT_TIMEOUT"
DEFAULT_HEARTBEAT_TIMEOUT = 20
_HOST_KEY = "keras_dp/host/{}"  # each process's host name, by index
# JAX's own default, for a runtime that `initialize` did not start.
_JAX_HEARTBEAT_TIMEOUT = 100
_heartbeat_s = None  # what `initialize` passed to JAX's runtime
# How much later than keras_dp's own timeout JAX's native deadline falls.
_JAX_DEADLINE_MARGIN_S = 60
# How long a process waits for the others at a round of keras_dp's own (`timeout`).
TIMEOUT_ENV = "KERAS_DP_AGREEMENT_TIMEOUT"
DEFAULT_TIMEOUT = 300
# Run at exit after `initialize`: `hook(uncaught)` of the modules that watch a
# call across processes (`keras_dp.multihost.peers`), then this process's own
# end; and `hook()` just before this process ends early (`end_now`).
EXIT_HOOKS = []
END_HOOKS = []


class NotEveryProcess(TimeoutError):
    """A process did not come to a call (or a stop) that the others made, within `timeout()`."""


def timeout():
    """Seconds a process waits for the others at a round: `KERAS_DP_AGREEMENT_TIMEOUT`, else 300.

    Raises:
        ValueError: the variable is not a positive number.
    """
    text = os.environ.get(TIMEOUT_ENV)
    if text is None:
        return DEFAULT_TIMEOUT
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0
    if not seconds > 0:
        raise ValueError(f"The environment variable {TIMEOUT_ENV} is a number of seconds "
                         f"above 0. Received: {TIMEOUT_ENV}={text!r}.") from None
    return seconds


def initialize(coordinator_address=None, num_processes=None, process_id=None, *,
               heartbeat_timeout_seconds=None, initialization_timeout=300,
               local_device_ids=None):
    """Join this process to the others through `jax.distributed.initialize`.

    Each argument left `None` is read from the environment
    (`KERAS_DP_COORDINATOR`, `KERAS_DP_NUM_PROCESSES`, `KERAS_DP_PROCESS_ID`,
    `KERAS_DP_HEARTBEAT_TIMEOUT`); what is still missing, JAX detects from
    the cluster (SLURM, Open MPI, Kubernetes, Cloud TPU pods).

    Call it once per process, before anything starts JAX's backend (the
    first `jax.devices()`, array or compiled call): JAX fixes its device
    list when it starts.

    Process 0 starts JAX's coordination service in a process of its own,
    and every process watches the others through it (`keras_dp.liveness`):
    when one is lost (SIGKILL, a lost host), every other one ends within
    the heartbeat timeout with one line naming it, the newest complete
    checkpoint and the command to resume, and status 75. A process that
    ends by an uncaught exception exits at once, with status 1, instead of
    waiting in JAX's shutdown for processes that wait for it. At a clean
    exit every process waits for the others at one barrier.

    Args:
        coordinator_address: `"host:port"` of process 0, reachable by all.
        num_processes: how many processes take part.
        process_id: this process's index, `0 <= process_id < num_processes`.
        heartbeat_timeout_seconds: after this many seconds without a
            heartbeat from a peer, JAX's coordination service counts it
            dead, and every other process ends with keras_dp's line instead
            of waiting in a collective for ever (default 20; JAX's own is 100).
        initialization_timeout: seconds to wait for every peer to connect.
        local_device_ids: the local accelerators this process uses (default:
            all it sees).

    Raises:
        RuntimeError: JAX has already started a backend.
        TimeoutError: not every process arrived within
            `initialization_timeout` (the message names the coordinator,
            this process and whether the coordinator's port answered). The
            process cannot join again and should exit.
        ValueError: a malformed environment variable.
        RuntimeError: process 0 could not start the coordination service
            (its port is taken).
    """
    if _compat.jax_backend_started():
        raise RuntimeError(
            "JAX has already started its backend, so this process can no "
            "longer join a multi-process run. Call "
            "keras_dp.distributed.initialize() first thing, before any "
            "jax.devices(), array or model creation (importing keras and "
            "keras_dp is fine)."
        )
    coordinator_address = coordinator_address or os.environ.get(COORDINATOR_ENV)
    num_processes = _int_arg(num_processes, NUM_PROCESSES_ENV)
    process_id = _int_arg(process_id, PROCESS_ID_ENV)
    heartbeat = _int_arg(heartbeat_timeout_seconds, HEARTBEAT_ENV) or heartbeat_timeout_setting()
    if None in (coordinator_address, num_processes, process_id):  # from the cluster, as JAX would
        coordinator_address, num_processes, process_id, local_device_ids = (
            _compat.detect_cluster(coordinator_address, num_processes, process_id,
                                   local_device_ids, initialization_timeout))
    # The coordination service in a process of its own (`keras_dp.liveness`), started
    # by process 0 of several; JAX's own, in the process, for one process alone.
    service = None
    if coordinator_address and (num_processes or 1) > 1 and process_id == 0:
        service = liveness.serve(coordinator_address.rpartition(":")[2], num_processes,
                                 heartbeat)

    def connect():
        with (_compat.joining_without_service() if service is not None
              else contextlib.nullcontext()):
            jax.distributed.initialize(
                coordinator_address, num_processes, process_id,
                local_device_ids=local_device_ids,
                # JAX's own deadline aborts the process natively, with no
                # Python exception: keras_dp's, shorter, raises first.
                initialization_timeout=initialization_timeout + _JAX_DEADLINE_MARGIN_S,
                heartbeat_timeout_seconds=heartbeat)

    _connect_within(initialization_timeout, coordinator_address, num_processes, process_id,
                    connect)
    global _heartbeat_s
    _heartbeat_s = heartbeat
    processes, me = _compat.distributed_processes()
    if processes > 1:
        liveness.watch(_compat.distributed_client(), processes, me, heartbeat, service)
    atexit.register(_end_after_uncaught_error)  # runs before JAX's own shutdown


def heartbeat_timeout_setting():
    """The heartbeat timeout `initialize` would pass: `KERAS_DP_HEARTBEAT_TIMEOUT`, else 20 s."""
    return _int_arg(None, HEARTBEAT_ENV) or DEFAULT_HEARTBEAT_TIMEOUT


def heartbeat_timeout():
    """Seconds after which JAX's runtime declares a silent process dead (as `initialize` set it)."""
    return _heartbeat_s or _JAX_HEARTBEAT_TIMEOUT


def _end_after_uncaught_error():
    """At exit after an uncaught exception, end this process at once.

    JAX's shutdown at exit waits (up to 300 s) for every process to shut
    down, while the others wait in the next collective for this one: both
    would hang. Ended now, this process stops its heartbeats, and the
    others' watchers end them within the heartbeat timeout
    (`keras_dp.liveness`). A clean exit (or a caught exception) waits for
    every process at one barrier and shuts down (`liveness.leave`), unless
    this process's error left a call the others were in and one of them
    ended for it (`keras_dp.multihost.peers`, an `EXIT_HOOKS` entry): then
    it ends too, with status 1, where the barrier would wait for it.
    """
    if _compat.jax_backend_started() and jax.process_count() > 1:
        uncaught = getattr(sys, "last_value", None) is not None
        for hook in EXIT_HOOKS:
            hook(uncaught)
        if uncaught:
            end_now()
    liveness.leave()  # every process at one barrier, before JAX's shutdown


def end_now():
    """End this process now, with status 1 (`END_HOOKS` first), flushing what it printed."""
    for hook in END_HOOKS:
        hook()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _connect_within(timeout, coordinator_address, num_processes, process_id, connect):
    """Run `connect` (JAX's rendezvous) and raise `TimeoutError` if it outlasts `timeout`.

    JAX's runtime reports a peer that never arrives by aborting the whole
    process from native code, which Python cannot catch. So the rendezvous
    runs on a daemon thread and this thread waits on it: past `timeout` the
    caller gets a `TimeoutError` that names the coordinator, this process
    and the timeout. The rendezvous cannot be retried in the same process
    (JAX keeps its half-made client), so the process should exit: the
    daemon thread does not hold it open.
    """
    finished = threading.Event()
    failure = []

    def rendezvous():
        try:
            connect()
        except BaseException as error:  # handed to the waiting thread
            failure.append(error)
        finally:
            finished.set()

    threading.Thread(target=rendezvous, name="keras_dp-initialize", daemon=True).start()
    if not finished.wait(timeout):
        raise TimeoutError(_never_arrived(timeout, coordinator_address, num_processes,
                                          process_id))
    if failure:
        raise failure[0]


def _never_arrived(timeout, coordinator_address, num_processes, process_id):
    who = "this process" if process_id is None else f"process {process_id}"
    of = "" if num_processes is None else f" of {num_processes}"
    where = coordinator_address or "the coordinator JAX detected from the cluster"
    reachable = _reachable(coordinator_address)
    seen = ("" if reachable is None else
            " The coordinator's port accepts connections, so it is up and "
            "another process is missing." if reachable else
            " Nothing accepts connections at that address: process 0 has not "
            "started, or the address or port is wrong or blocked.")
    return (
        f"keras_dp.distributed.initialize: {who}{of} waited {timeout} s at "
        f"{where} and not every process arrived.{seen} Start every process "
        "with the same coordinator address and process count, each with its "
        "own process id, or pass a longer initialization_timeout. This "
        "process cannot join again; exit and start it anew."
    )


def _reachable(address):
    """Whether a TCP connection to `"host:port"` opens (None: no address to try)."""
    if not address or ":" not in address:
        return None
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
            return True
    except (OSError, ValueError):
        return False


def requested_by_environment():
    """Whether the `KERAS_DP_*` variables ask this process to join others."""
    return COORDINATOR_ENV in os.environ


def check_joined():
    """Raise if the `KERAS_DP_*` variables ask for several processes and JAX runs this one alone.

    `keras-dp launch` (or a scheduler's script) sets them, but only
    `initialize` joins the processes: a program that never calls it runs as
    one process of its own in each, every one training alone on all it
    reads and writing the same files, with no error.

    Raises:
        RuntimeError: `KERAS_DP_NUM_PROCESSES` is above 1 and JAX sees one
            process.
    """
    if not requested_by_environment():
        return
    expected = _int_arg(None, NUM_PROCESSES_ENV)
    if expected is None or expected <= 1 or jax.process_count() > 1:
        return
    raise RuntimeError(
        f"This process was started as process {os.environ.get(PROCESS_ID_ENV, '?')} of "
        f"{expected} ({COORDINATOR_ENV}={os.environ[COORDINATOR_ENV]}, "
        f"{NUM_PROCESSES_ENV}={expected}, as keras-dp launch sets them), but JAX "
        "runs it alone: keras_dp.distributed.initialize() was not called, so each "
        "process would train by itself on all the data it reads. Call "
        "keras_dp.distributed.initialize() first thing in the program, before any "
        "jax.devices(), array or model creation; or unset "
        f"{COORDINATOR_ENV} to run one process alone."
    )


def is_primary():
    """Whether this is process 0, the one that prints and writes files."""
    return jax.process_index() == 0


def barrier(name):
    """Wait until every process reaches the barrier of the same `name`."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def publish_host_name():
    """Leave this process's host name where every process can read it (`host_names`).

    In JAX's coordination service's key-value store, once per process;
    nothing in one process. Every process does it as it makes a trainer
    across processes (`keras_dp.multihost.batches.MultiProcessPlacement`).
    """
    if jax.process_count() == 1:
        return
    try:
        _compat.distributed_client().key_value_set(
            _HOST_KEY.format(jax.process_index()), socket.gethostname())
    except jax.errors.JaxRuntimeError:
        pass  # ALREADY_EXISTS: left before


def host_names():
    """Every process's host name (`socket.gethostname()`), by process index.

    Read from JAX's coordination service, where each process leaves its
    own (`publish_host_name`), not gathered through the devices: one
    process alone may call it (process 0, to print `trainer.describe()`).

    Raises:
        NotEveryProcess: a process left no name within `timeout()`
            seconds (it made no trainer).
    """
    publish_host_name()
    client, seconds = _compat.distributed_client(), timeout()
    names = []
    for process in range(jax.process_count()):
        try:
            names.append(client.blocking_key_value_get(_HOST_KEY.format(process),
                                                       int(1000 * seconds)))
        except jax.errors.JaxRuntimeError as error:
            if not _compat.key_value_timed_out(error):
                raise
            raise NotEveryProcess(
                f"Process {jax.process_index()} waited {seconds:g} s for process "
                f"{process}'s host name, which each process leaves as it makes a "
                "ShardedTrainer (or calls fit_sharded). Make the same trainers on "
                f"every process. ({TIMEOUT_ENV} sets how long a process "
                "waits.)") from None
    return names


def process_share(*arrays):
    """This process's contiguous share of arrays that every process holds whole.

    Process p of P gets rows `p * n // P` to `(p + 1) * n // P`, so the
    shares cover every row once and differ in length by at most one.

    Returns:
        The slice of each array (a single array for a single argument).
    """
    index, count = jax.process_index(), jax.process_count()
    shares = tuple(
        array[index * len(array) // count:(index + 1) * len(array) // count]
        for array in arrays
    )
    return shares[0] if len(shares) == 1 else shares


def local_batch_size(batch_size, mesh):
    """The rows per step each process slices from its share: global / processes.

    Raises:
        ValueError: a global batch that does not divide by the process count.
    """
    processes = len(block_order(mesh))
    if batch_size % processes:
        raise ValueError(
            "With several processes, `batch_size` is the global batch and "
            "each process slices batch_size / process_count rows from its "
            f"own data, so it must divide. Received: batch_size={batch_size} "
            f"with {processes} processes. Use a multiple of {processes}."
        )
    return batch_size // processes


def block_order(mesh):
    """The processes in the order of their blocks of rows along `"batch"`.

    Raises:
        ValueError: a process's devices are not one contiguous run of the
            mesh, the runs differ in length, or a process has no device.
    """
    owners = [device.process_index for device in mesh.devices.flat]
    order = [owner for i, owner in enumerate(owners) if i == 0 or owners[i - 1] != owner]
    per_process = len(owners) // len(order)
    if (len(order) != len(set(order)) or len(order) != jax.process_count()
            or len(owners) % len(order)
            or any(owners.count(owner) != per_process for owner in order)):
        raise ValueError(
            "Across processes, keras_dp needs a mesh in which every process "
            "owns one contiguous run of devices, all runs of one length. "
            f"Received a mesh whose devices belong to processes {owners}. "
            "Build it with keras_dp.make_mesh() (all devices, in JAX's order)."
        )
    return order


def _int_arg(value, env):
    if value is not None:
        return int(value)
    text = os.environ.get(env)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"The environment variable {env} must be an integer. Received: "
            f"{env}={text!r}."
        ) from None
