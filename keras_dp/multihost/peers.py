"""A process whose `fit` fails while the others train tells them, and they stop saying why.

Across processes, an error that one process alone raises inside `fit`,
`evaluate` or `predict` (a callback that fails on it only) takes it out of
the steps, while the others wait for it in the next step's collective,
where no Python code of theirs runs. If the error ends that process, JAX's
runtime stops the others after the heartbeat timeout with its own
"detected fatal errors"; if the program catches it, nothing stopped them
before, and at its exit JAX's shutdown waited for them (300 s).

So while a call runs, the failing process posts its error on a `Notice`
(JAX's coordination service) as the error leaves the call, and a thread of
every other process watches for it: a process still inside the call
`grace()` seconds after the notice is waiting for the failed one, and ends
itself (status 1) with a message naming that process and its error, after
posting that it ended. A process that leaves the call within `grace()` (an
error that every process raises, caught or not) is left alone. The failed
process, at its exit, ends too (status 1) instead of waiting in JAX's
shutdown for processes that have ended (`distributed`'s exit hook); process
0, whose end takes JAX's coordination service down with it, ends last.
"""

import contextlib
import os
import sys
import threading
import time

import jax

from keras_dp import distributed as distributed_lib
from keras_dp import liveness
from keras_dp.multihost import agreement
from keras_dp.multihost import channel as exchange_lib

# Raised by every process at the same point: no process waits for another.
_EVERY_PROCESS = (FloatingPointError, SystemExit, agreement.Disagreement)
_POLL_S = 0.25
_REASON_CHARS = 400
_posted = []  # (`ended`, `gone` notices, time) of each failure this process posted


def grace():
    """Seconds a process inside a call waits after a peer's failure: half the heartbeat timeout."""
    return distributed_lib.heartbeat_timeout() / 2


def ended_for_this_process():
    """Whether a process ended because this one's error left a call it was in.

    Waits until `grace()` + 2 s after the last failure this process posted,
    as long as no process has said so: the others end only after
    `grace()`. A coordination service that no longer answers (process 0
    ended) counts as ended.
    """
    if not _posted:
        return False
    ended, _, since = _posted[-1]
    deadline = since + grace() + 2
    while True:
        try:
            if ended.read() is not None:
                return True
        except exchange_lib.Closed:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)


def leaving():
    """Say, on each failure this process posted, that it is about to end."""
    for _, gone, _ in _posted:
        gone.post(str(jax.process_index()))


@contextlib.contextmanager
def watch(hosts, call="fit"):
    """The span of a `call` across processes: post an error that leaves it, watch for others'.

    `hosts` is the trainer's `keras_dp.multihost.hosts.ManyProcesses` (its `exchange`).
    """
    failed, ended, gone = (hosts.exchange.notice() for _ in range(3))
    stopped = threading.Event()
    threading.Thread(target=_watch, args=(failed, ended, gone, stopped, call), daemon=True,
                     name="keras_dp-peers").start()
    try:
        yield
    except BaseException as error:
        # A step whose peer died: the watcher ends this process naming it.
        liveness.await_verdict(error, distributed_lib.heartbeat_timeout() + 5)
        if not isinstance(error, _EVERY_PROCESS):
            failed.post(f"{jax.process_index()}|{type(error).__name__}: {error}"[:_REASON_CHARS])
            _posted.append((ended, gone, time.monotonic()))
        raise
    finally:
        stopped.set()


def _watch(failed, ended, gone, stopped, call):
    while not stopped.wait(_POLL_S):
        try:
            text = failed.read()
        except exchange_lib.Closed:  # JAX's runtime reports it
            return
        if text is None:
            continue
        process, _, reason = text.partition("|")
        if int(process) == jax.process_index() or stopped.wait(grace()):
            return
        ended.post(str(jax.process_index()))
        _end(int(process), reason, call, gone)


def _end(process, reason, call, gone):
    print(
        f"keras_dp: process {process} left {call} with an error while this process "
        f"(process {jax.process_index()}) was still in it: {reason}\n"
        f"keras_dp: this process waits for process {process} in the next step and "
        f"cannot go on without it, so it ends now (status 1, {grace():g} s after the "
        f"error). Fix the error on process {process}; across processes, an error that "
        f"one process alone raises in {call} must end the run: catch it on every "
        "process or on none.", file=sys.stderr, flush=True)
    sys.stdout.flush()
    if distributed_lib.is_primary():
        # The coordination service ends with this process, and with it, at
        # once, any process still joined to it (with a native abort): wait
        # for the failed process to end first, as long as the heartbeat allows.
        deadline = time.monotonic() + distributed_lib.heartbeat_timeout()
        with contextlib.suppress(exchange_lib.Closed):
            while gone.read() is None and time.monotonic() < deadline:
                time.sleep(_POLL_S)
    os._exit(1)


def _at_exit(uncaught):
    """At exit (`distributed.EXIT_HOOKS`): end now where a call this process left waits for it.

    After an uncaught error, end at once, except process 0 whose error the
    others were told of: it ends last (below). Then, uncaught or not, if a
    process ended because this one's error left a call it was in, end too
    (status 1), where JAX's shutdown would wait for it. Process 0 runs the
    coordination service, whose end stops the others at once with JAX's
    own error: it first waits for them to end with keras_dp's message.
    """
    if uncaught and not (_posted and distributed_lib.is_primary()):
        distributed_lib.end_now()
    if ended_for_this_process():
        if not uncaught:
            print(f"keras_dp: process {jax.process_index()} ends with status 1: its error "
                  "left a call the other processes were in, and they have ended.",
                  file=sys.stderr)
        distributed_lib.end_now()


distributed_lib.EXIT_HOOKS.append(_at_exit)
distributed_lib.END_HOOKS.append(leaving)  # process 0 may wait for it before ending
