"""A process that stops answering: every other one ends with one line, not JAX's native abort.

Across processes, JAX's coordination service hears a heartbeat from every
process. One that dies without a word (SIGKILL, an out-of-memory kill, a
lost host) is missed for the heartbeat timeout, and JAX then aborted every
other process from native code with a C++ check-failure stack trace
("Terminating process because the JAX distributed service detected fatal
errors"); at once, when the dead one was process 0, whose death took the
service with it. jaxlib's hook for that moment (`missed_heartbeat_callback`)
cannot be set from Python: it receives an `absl::Status`, which jaxlib
cannot hand to Python (`std::bad_cast`, and the process aborts). So
`keras_dp.distributed.initialize`:

- runs the coordination service in a process of its own, which process 0
  starts (`serve`) and which outlives it long enough for the others to learn
  of its death (`_compat.SERVICE_PROGRAM`);
- makes that service recoverable: a process that dies is reported to the
  processes that ask, instead of as a fatal error to every other one;
- asks, on a thread of every process, which processes are alive (`watch`:
  `_compat.live_processes`, JAX's verdict from its own heartbeats), and when
  one is gone ends this process with one line (`lost_message`): which
  process stopped answering, the newest complete checkpoint
  (`note_checkpoint`), and the command to resume; with status `LOST_STATUS`
  (75, EX_TEMPFAIL: try again), within the heartbeat timeout (and the
  watcher's half-second poll) of the death;
- at a clean exit, waits for every process at a barrier (`leave`): a
  recoverable service's own shutdown barrier holds no one back.

A process in a collective with the dead one learns of it sooner, as a step's
error (gloo's "Connection closed by peer"); `fit` then waits for the
watcher's verdict (`await_verdict`) rather than raising that error.
"""

import os
import shlex
import subprocess
import sys
import threading
import time

from keras_dp import _compat

LOST_STATUS = 75  # os.EX_TEMPFAIL: a temporary failure, try again
RESUME_COMMAND_ENV = "KERAS_DP_RESUME_COMMAND"
_POLL_S = 0.5
# Words in a step's error that say a peer's connection went away (gloo on CPU, NCCL on GPU).
_CONNECTION_LOST = ("Connection closed", "Connection reset", "Socket closed", "Broken pipe",
                    "UNAVAILABLE", "NCCL")
# How long a clean exit waits for the other processes at the exit barrier (JAX's own default).
EXIT_BARRIER_S = 300
_watch = None  # the `_Watch` of this process, once `watch` started it
_checkpoint = {}  # the newest complete checkpoint this process knows of (`note_checkpoint`)


def serve(port, processes, heartbeat_seconds):
    """Start JAX's coordination service in a process of its own, listening on `port`.

    Called by process 0 before it joins. Returns the service's process,
    which `leave` tells of a clean exit.

    Raises:
        RuntimeError: the service did not start (the port is taken, say).
    """
    linger = 2 * heartbeat_seconds + 10
    child = subprocess.Popen(
        [sys.executable, "-c", _compat.SERVICE_PROGRAM, f"[::]:{port}", str(processes),
         str(heartbeat_seconds), str(linger)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    said = child.stdout.readline().decode().strip()
    if said != "ready":
        child.kill()
        raise RuntimeError(
            f"keras_dp.distributed.initialize: process 0 could not start JAX's coordination "
            f"service on port {port} ({said or 'it ended without a word'}). Pass a free port "
            "in the coordinator address, or end the program that holds it.")
    return child


class _Watch:
    def __init__(self, client, processes, me, heartbeat_seconds, service):
        self.client, self.processes, self.me = client, processes, me
        self.heartbeat, self.service = heartbeat_seconds, service
        self.leaving = threading.Event()  # at the exit barrier
        self.stopping = threading.Event()  # past it

    def run(self):
        everyone = range(self.processes)
        while not self.stopping.is_set():
            try:
                live = _compat.live_processes(self.client, everyone)
            except Exception:  # noqa: BLE001 - the service is gone, or this process is leaving
                if (self.stopping.wait(2 if self.leaving.is_set() else 0)
                        or _compat.distributed_client() is None):
                    return  # leaving, or the program shut JAX's client down itself
                end(None, self.me, self.heartbeat)
            lost = sorted(set(everyone) - live - {self.me})
            # At the exit barrier, a peer past it may shut down first: wait to be past it too.
            if lost and not self.stopping.wait(2 if self.leaving.is_set() else 0):
                end(lost, self.me, self.heartbeat)
            time.sleep(_POLL_S)


def watch(client, processes, me, heartbeat_seconds, service=None):
    """Watch the other processes from a thread of this one, for the rest of its life (see the module doc).

    `service`: the coordination service's process, if this one started it.
    """
    global _watch
    _watch = _Watch(client, processes, me, heartbeat_seconds, service)
    _watch.thread = threading.Thread(target=_watch.run, name="keras_dp-liveness", daemon=True)
    _watch.thread.start()


def watching():
    """Whether this process watches others (it joined several with `distributed.initialize`)."""
    return _watch is not None


def leave():
    """At a clean exit: stop watching, wait for every process, shut down, let the service end.

    Every process passes a barrier before any shuts its client down, so no
    process loses the service while another still uses it. The watcher
    watches on until then: a process that dies before it arrives ends this
    one with its line (the barrier would wait `EXIT_BARRIER_S` for it). Then
    JAX's client is shut down here (`jax.distributed.shutdown`), which ends
    the watcher's pending call: a call that ended during the interpreter's
    finalization would abort the process ("FATAL: exception not rethrown").
    """
    if _watch is None or _watch.leaving.is_set():
        return
    _watch.leaving.set()
    try:
        _compat.wait_at_barrier(_watch.client, "keras_dp/exit", EXIT_BARRIER_S)
    except Exception:  # noqa: BLE001 - late past EXIT_BARRIER_S: this process exits anyway
        pass
    _watch.stopping.set()
    import jax

    jax.distributed.shutdown()
    _watch.thread.join(timeout=5)
    if _watch.service is not None:
        try:
            _watch.service.stdin.write(b"done")
            _watch.service.stdin.close()
        except OSError:
            pass


def await_verdict(error, seconds):
    """After `error` leaves a step, wait up to `seconds` for the watcher to find a peer gone.

    A step whose peer died fails with a transport error (gloo's
    "Connection closed by peer") before JAX's heartbeat has missed it: the
    watcher then ends this process with the one line that names the peer.
    Returns (to raise `error`) if `error` does not name a lost connection,
    or nothing was found in time.
    """
    text = " ".join(str(each) for each in (error, error.__cause__, error.__context__) if each)
    if _watch is None or not any(words in text for words in _CONNECTION_LOST):
        return
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(_POLL_S)  # the watcher ends the process from its thread


def note_checkpoint(directory, index, words):
    """Record the newest complete checkpoint: `index` in `directory`, `words` saying where it stands."""
    _checkpoint.update(directory=str(directory), index=int(index), words=words)


def end(lost, me, heartbeat_seconds):
    """Say which processes (None: the service) stopped answering and how to resume; exit `LOST_STATUS`."""
    print(lost_message(lost, me, heartbeat_seconds), file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(LOST_STATUS)


def lost_message(lost, me, heartbeat_seconds):
    """The one line a process ends with when processes `lost` (None: the service) stopped answering."""
    if lost is None:
        who = "JAX's coordination service stopped answering"
    else:
        who = (f"process {lost[0]}" if len(lost) == 1 else
               "processes " + ", ".join(map(str, lost)))
        who += (" stopped answering (JAX's coordination service heard no heartbeat for "
                f"{heartbeat_seconds} s)")
    return (
        f"keras_dp: {who}, so this process (process {me}) ends now, "
        f"with status {LOST_STATUS}. {_checkpoint_words()} To resume, run the same command "
        "again, on this number of processes or another: "
        f"{os.environ.get(RESUME_COMMAND_ENV) or shlex.join(sys.orig_argv)}")


def _checkpoint_words():
    """The newest complete checkpoint, in words (it is on disk whole: a cut save is never read)."""
    if not _checkpoint:
        return ("No checkpoint was saved (pass checkpoint_dir to fit to resume from the "
                "last one).")
    directory, index = _checkpoint["directory"], _checkpoint["index"]
    newest = newest_complete(directory)
    if newest is None:
        return f"No complete checkpoint is in {directory}."
    where = f" ({_checkpoint['words']})" if newest == index else ""
    return (f"The newest complete checkpoint, {os.path.join(directory, str(newest))}{where}, "
            "is intact; a save cut short leaves only a temporary directory, never read.")


def newest_complete(directory):
    """The highest step orbax committed in `directory` (a directory named by digits), or None."""
    try:
        steps = [int(name) for name in os.listdir(directory) if name.isdigit()]
    except OSError:
        return None
    return max(steps, default=None)
