"""SIGTERM as a request to save and stop at the next step boundary.

A preempted job gets SIGTERM and some seconds before it is killed. `fit`
watches for it (the hosts' `preemption`) and, between two steps, saves a
checkpoint and ends the process with status 143 (`exit_after_preemption`),
as SIGTERM's default action would. One process uses a Python handler
(`Preemption`); across processes JAX's runtime catches the signal in every
process and they agree on one step at which all of them stop
(`keras_dp.multihost.hosts.SyncedPreemption`), so the checkpoint they
write together is whole.
"""

import contextlib
import signal
import sys
import threading


class Preemption:
    """Turns SIGTERM into a request to save and stop, for a `with` block.

    The handler only records the signal; the trainer acts on it between two
    steps. So the signal never interrupts a checkpoint being written, and
    the state saved is one the run really reached. Outside the main thread,
    where Python cannot install handlers, it does nothing.
    """

    def __init__(self):
        self.requested = False
        self._handling = contextlib.ExitStack()

    def __enter__(self):
        self._handling.enter_context(handling_sigterm(self._handle))
        return self

    def __exit__(self, *exc_info):
        self._handling.close()

    def _handle(self, signum, frame):
        self.requested = True

    def exit(self, directory, position):
        """Say where the run stopped and end the process as SIGTERM would (143)."""
        exit_after_preemption(directory, position)


@contextlib.contextmanager
def handling_sigterm(handler):
    """Call `handler(signum, frame)` on SIGTERM inside the block, then put back the one before.

    Outside the main thread, where Python cannot install handlers, nothing
    is installed. Where the handler before was set outside Python
    (`signal.signal` returns None), it cannot be put back: the default
    action (end the process) is, rather than `handler`, whose owner is gone.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def exit_after_preemption(directory, position):
    """Say where the run stopped and end the process as SIGTERM would (143).

    `directory` is where the checkpoint was saved, or None when there is
    none (a run across processes without `checkpoint_dir`).
    """
    where = position.at()
    print(
        f"keras_dp: SIGTERM received; saved a checkpoint in {directory} "
        f"{where}. Run the same fit with the same checkpoint_dir to resume "
        "from there." if directory is not None else
        f"keras_dp: SIGTERM received; every process stopped {where}. "
        "Nothing was saved: pass checkpoint_dir to fit to resume after a SIGTERM.",
        file=sys.stderr, flush=True,
    )
    raise SystemExit(128 + signal.SIGTERM)
