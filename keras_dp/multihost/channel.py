"""Small host-side exchanges between processes, through JAX's coordination service.

Across processes, keras_dp must agree on a few integers that no step
computes: how many rows each process has for the coming steps, and whether
any process's callbacks changed the model. They travel through the
key-value store of JAX's coordination service (the one every process joins
in `jax.distributed.initialize`), not through the devices: an exchange is
not an XLA collective, so it may run on the look-ahead thread while the
devices compute, in any order relative to the steps, and it costs one host
round trip to the coordinator.

Each exchange happens on a `Channel`; every process opens the same
channels in the same order (`Exchange.channel`, from the main thread) and
makes the same rounds on each, so the numbered keys meet. Each process
deletes its keys once every process has read them, except a channel's last
two rounds' (a few bytes per channel, a few channels per epoch).
"""

import itertools
import time

import jax

from keras_dp import _compat

# Trainers are made in the same order in every process (it runs the same
# program), so this numbering names each one's keys alike in every process.
_exchanges = itertools.count()


class Closed(Exception):
    """The reader of a channel went away while a round was waiting."""


class TimedOut(Exception):
    """A round waited its channel's `timeout` for a process that did not publish.

    Attributes:
        process: the first process whose values did not arrive.
    """

    def __init__(self, key, process):
        super().__init__(key)
        self.process = process


class Exchange:
    """The channels of one trainer's placement (see the module doc).

    Attributes:
        rounds: how many rounds (host round trips) its channels have made.
    """

    def __init__(self):
        self._client = _compat.distributed_client()
        self._prefix = f"keras_dp/{next(_exchanges)}"
        self._channels = itertools.count()
        self.rounds = 0

    def channel(self, closed=None, timeout=None):
        """A new channel: call in the same order on every process.

        `closed` (a `threading.Event`) ends a waiting round with `Closed`;
        past `timeout` seconds (None: never) a round raises `TimedOut`.
        """
        return Channel(self, f"{self._prefix}/{next(self._channels)}", closed, timeout)

    def notice(self):
        """A new `Notice`: call in the same order on every process, as `channel`."""
        return Notice(self._client, f"{self._prefix}/{next(self._channels)}")

    def any_process(self, flag):
        """Whether `flag` is true on any process (one round on a new channel)."""
        return any(values[0] for values in self.channel().all_gather([int(flag)]))


class Channel:
    """Numbered rounds of `all_gather`, the same on every process."""

    def __init__(self, exchange, name, closed, timeout=None):
        self._exchange, self._name, self._closed = exchange, name, closed
        self._timeout = timeout
        self._rounds = itertools.count()

    def all_gather(self, values):
        """Every process's list of integers `values`, indexed by process.

        Publishes this process's list, then waits for every other's. The
        key of round r - 2 is deleted then: every process has read it, as
        each publishes round r - 1 only after reading all of round r - 2.

        Raises:
            Closed: `closed` was set while waiting.
            TimedOut: a process did not publish within the channel's `timeout`.
        """
        client, me = self._exchange._client, jax.process_index()
        index = next(self._rounds)
        client.key_value_set(self._key(index, me), _encode(values))
        if index >= 2:
            client.key_value_delete(self._key(index - 2, me))
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        gathered = [values if process == me else
                    _decode(self._get(self._key(index, process), process, deadline))
                    for process in range(jax.process_count())]
        self._exchange.rounds += 1
        return gathered

    def _key(self, index, process):
        return f"{self._name}/{index}/{process}"

    def _get(self, key, process, deadline):
        # A dead peer ends this process through the runtime's heartbeat; a
        # closed reader or the deadline ends the wait here, within a second.
        while True:
            wait_ms = 1000 if deadline is None else int(
                1000 * min(1, max(0.001, deadline - time.monotonic())))
            try:
                return self._exchange._client.blocking_key_value_get(key, wait_ms)
            except jax.errors.JaxRuntimeError as error:
                if not _compat.key_value_timed_out(error):
                    raise
            if self._closed is not None and self._closed.is_set():
                raise Closed(key)
            if deadline is not None and time.monotonic() >= deadline:
                raise TimedOut(key, process)


class Notice:
    """One text that the first process to post it leaves for every process to read."""

    def __init__(self, client, key):
        self._client, self._key = client, key

    def post(self, text):
        """Leave `text`, unless a process has left its own already."""
        try:
            self._client.key_value_set(self._key, text)
        except jax.errors.JaxRuntimeError:
            # ALREADY_EXISTS: the first one stands. Or the service no longer
            # answers (process 0 ended): notices are posted while a failure
            # is being reported, which an error here must not replace.
            pass

    def read(self):
        """The text left, or None (at once: no wait).

        Raises:
            Closed: the coordination service no longer answers (process 0 ended).
        """
        try:
            return self._client.key_value_try_get(self._key)
        except jax.errors.JaxRuntimeError as error:
            if _compat.key_value_not_found(error):
                return None
            raise Closed(self._key) from None


def _encode(values):
    """Run-length text: `[32, 32, 32, 7]` -> `"32*3,7*1"` (an epoch's plan is short)."""
    runs = [(value, len(list(group))) for value, group in itertools.groupby(values)]
    return ",".join(f"{int(value)}*{count}" for value, count in runs)


def _decode(text):
    values = []
    for run in filter(None, text.split(",")):
        value, count = run.split("*")
        values.extend([int(value)] * int(count))
    return values
