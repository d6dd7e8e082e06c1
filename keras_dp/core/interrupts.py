"""Holding Ctrl-C (SIGINT) back while the training state changes hands.

A compiled step consumes (donates) the state it is given and returns its
successor. Python runs a signal handler between any two bytecodes, so a
`KeyboardInterrupt` raised by the default handler can land after the call
returned and before its result was stored: the old state is gone and the
new one is dropped with the frame that held it. `Deferred` closes that
window. While it is entered (for the whole of `fit`), SIGINT runs its
handler, which calls the previous handler (Python's: raise
`KeyboardInterrupt`) at once, except inside a `held()` block: there it only
notes the signal, and the previous handler runs when the block ends, after
the new state is recorded. A hand-over is one step's dispatch (on the first
call, its compilation too), so Ctrl-C waits at most that long; a
checkpoint being written is held too, until it is complete.
"""

import contextlib
import signal
import threading


class Deferred:
    """SIGINT, run at once outside `held()` blocks and at their end inside them.

    Outside the main thread, or when SIGINT's handler is not a Python
    function (ignored, or the system default), entering changes nothing and
    `held()` holds nothing back.
    """

    def __init__(self):
        self._previous = None
        self._depth = 0
        self._pending = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGINT)
            if callable(previous):
                self._previous = previous
                signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc_info):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    @contextlib.contextmanager
    def held(self):
        """A block that SIGINT does not interrupt; a signal that came runs at its end."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth and self._pending is not None:
                pending, self._pending = self._pending, None
                self._previous(*pending)  # Python's default raises KeyboardInterrupt

    def _handle(self, signum, frame):
        if self._depth:
            self._pending = (signum, frame)
        else:
            self._previous(signum, frame)
