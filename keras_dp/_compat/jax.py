"""JAX's private hooks: its backend and its distributed runtime (coordination service, client)."""

import contextlib


def jax_backend_started():
    """Whether JAX has started a backend (then devices can no longer change).

    There is no public way to ask: `jax._src.xla_bridge.backends_are_initialized`.
    """
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def distributed_client():
    """The client of JAX's coordination service, or None in a single process.

    `jax._src.distributed.global_state.client`, the connection every process
    opens in `jax.distributed.initialize`; its key-value store
    (`key_value_set`, `blocking_key_value_get`, `key_value_try_get`,
    `key_value_delete`) carries small host-side values between processes
    without a device collective.
    """
    from jax._src import distributed

    return distributed.global_state.client


def distributed_processes():
    """`(process count, this process's index)` as `jax.distributed.initialize` set them.

    `jax._src.distributed.global_state.num_processes` and `.process_id`:
    read without starting JAX's backend, as `jax.process_count()` would.
    """
    from jax._src import distributed

    state = distributed.global_state
    return int(state.num_processes or 1), int(state.process_id or 0)


def detect_cluster(coordinator_address, num_processes, process_id, local_device_ids,
                   initialization_timeout):
    """What `jax.distributed.initialize` detects from the cluster (SLURM, Open MPI, Kubernetes, ...).

    `jax._src.clusters.ClusterEnv.auto_detect_unset_distributed_params`,
    the call JAX makes first for the arguments left None; made here first
    so that keras_dp knows whether this is process 0 (which starts the
    coordination service). Returns the four values, the given ones kept.
    """
    from jax._src import clusters

    return clusters.ClusterEnv.auto_detect_unset_distributed_params(
        coordinator_address, num_processes, process_id, local_device_ids, None,
        initialization_timeout)


def key_value_timed_out(error):
    """Whether a `JaxRuntimeError` of `blocking_key_value_get` is its wait running out.

    The coordination service says so only in the text ("DEADLINE_EXCEEDED").
    """
    return "DEADLINE_EXCEEDED" in str(error)


def key_value_not_found(error):
    """Whether a `JaxRuntimeError` of `key_value_try_get` says the key is not there ("NOT_FOUND")."""
    return "NOT_FOUND" in str(error)


# The program of the process that hosts JAX's coordination service apart
# from the training processes (`keras_dp.liveness.serve`). It imports only
# jaxlib (a fraction of a second), ignores SIGTERM and SIGINT (a scheduler's
# signal to the job, a terminal's Ctrl-C: the training processes need the
# service to save and stop together), says "ready" once the service listens,
# and ends 2 s after process 0 writes "done" to it, or `linger` seconds after
# process 0 is gone otherwise (its pipe closed, or its parent changed), so
# that the others can still learn which process stopped answering.
SERVICE_PROGRAM = r'''
import os, select, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
import jaxlib._jax as jaxlib_jax
address, processes, heartbeat, linger = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
parent = os.getppid()
try:
    service = jaxlib_jax.get_distributed_runtime_service(
        address, processes, heartbeat_timeout=heartbeat, recoverable=True)
except Exception as error:
    print("failed", str(error).splitlines()[0][:300], flush=True)
    os._exit(1)
print("ready", flush=True)
said = b""
while os.getppid() == parent:
    if select.select([0], [], [], 0.5)[0]:
        chunk = os.read(0, 64)
        said += chunk
        if not chunk:
            break
time.sleep(2 if said.startswith(b"done") else linger)
os._exit(0)
'''


class _NoService:
    """What process 0's `jax.distributed.initialize` holds instead of the service it would start."""

    def shutdown(self):
        """Nothing: the service lives in a process of its own (`SERVICE_PROGRAM`)."""


@contextlib.contextmanager
def joining_without_service():
    """`jax.distributed.initialize` inside the block starts no coordination service in process 0.

    JAX starts it in process 0 (`jax._src.distributed.State.initialize`
    calls `_jax.get_distributed_runtime_service` when `process_id == 0`),
    so process 0's death took the service down, and JAX's client then
    aborted every other process natively at once. Here that call returns a
    stand-in; the service runs in a process of its own (`SERVICE_PROGRAM`).
    """
    from jax._src import distributed

    real = distributed._jax

    class Without:
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def get_distributed_runtime_service(*args, **kwargs):
            return _NoService()

    distributed._jax = Without()
    try:
        yield
    finally:
        distributed._jax = real


def live_processes(client, processes):
    """The processes among `processes` that JAX's coordination service counts alive: a set.

    `DistributedRuntimeClient.get_live_nodes`, which returns once every live
    process among them has asked (a barrier of the live ones), so every
    process asks in a loop; a process is dropped once the service has heard
    no heartbeat from it for the heartbeat timeout.
    """
    return set(client.get_live_nodes(list(processes)))


def wait_at_barrier(client, name, timeout_seconds):
    """Wait until every process has reached barrier `name` of JAX's coordination service.

    `DistributedRuntimeClient.wait_at_barrier`: the shutdown barrier JAX's
    client holds at exit blocks no process when the service is recoverable.
    """
    client.wait_at_barrier(name, int(1000 * timeout_seconds))
