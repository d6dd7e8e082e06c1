"""Hosts: everything a fit does differently when its mesh spans processes, behind one object.

A trainer holds one hosts object (`hosts_for`), and the core asks it rather
than the process count: `OneProcess`, whose agreement rounds are no-ops, or
`ManyProcesses`, which assembles global batches from every process's share
(`keras_dp.multihost.batches`), agrees on settings, stops and reads
(`keras_dp.multihost.agreement`), ends a call that a peer left with an
error (`keras_dp.multihost.peers`), and stops every process at one step on
SIGTERM (`SyncedPreemption`).

What both give:

- `primary`: whether this process prints and writes files (process 0);
  `whole_data`: whether this process holds all of the data (resident data
  needs it); `compiles_ahead`: whether programs are compiled ahead of use;
  `reads_collectively`: whether reading the state into the model is a
  collective every process must join (a state split across processes);
- `steps(host_batches, K, template, rows)`: one pass's `(steps, DeviceBatch)`;
  `shard(batch)`; `local_batch_size(global)`; `local_rows(output, batch)`
  and `stacked_local_rows`: this process's rows of a batch-split output;
- `any_process(flag)`; `any_reads(flag, sync)`: whether any process must
  read the model, `sync` first where it must; `stop_together(model, stop)`:
  whether training stops after an epoch, on every process alike;
- `preparing(call)`, `watch(call)` (context managers around a call),
  `fit_settings`/`inference_settings` (what must agree), `same_start`,
  `stop_mid_epoch`/`stop_mid_pass` (a callback's stop, checked before the
  next batch is placed), `before_gather` (a read's round, or None),
  `preemption(saving)` (the SIGTERM watcher), `host_names()`.
"""

import contextlib
import functools
import itertools

import numpy as np

from keras_dp import distributed
from keras_dp import sharding
from keras_dp.checkpoint import preemption as preemption_lib
from keras_dp.core import feed
from keras_dp.multihost import agreement
from keras_dp.multihost import batches as batches_lib
from keras_dp.multihost import peers


def hosts_for(layout, prefetch=0):
    """The hosts of `layout`'s mesh: `ManyProcesses` if it spans processes, else `OneProcess`."""
    if layout.spans_processes:
        return ManyProcesses(layout, prefetch)
    return OneProcess(layout, prefetch)


class OneProcess:
    """One process holds the whole mesh: nothing to agree on, every batch its own.

    Args:
        layout: the trainer's `keras_dp.sharding.Layout`.
        prefetch: how many placed batches (or stacks) a background thread
            prepares ahead of the step that needs them (0: in line).
    """

    whole_data = True
    compiles_ahead = True
    reads_collectively = False
    before_gather = None
    primary = True

    def __init__(self, layout, prefetch=0):
        self.layout, self.prefetch = layout, prefetch

    @property
    def steps(self):
        """`steps(host_batches, K, template, rows)`: `feed.place_steps` on this layout.

        `template` and `rows` serve the plan across processes only.
        """
        return functools.partial(feed.place_steps, layout=self.layout,
                                 prefetch_depth=self.prefetch)

    def shard(self, batch):
        """One host batch, split by rows over the mesh: a `DeviceBatch`."""
        return sharding.to_device(batch, self.layout)

    def local_batch_size(self, batch_size):
        """The rows this process slices per step for a global `batch_size`: all of them."""
        return batch_size

    def local_rows(self, output, batch):
        """The real rows of a batch-split output, as numpy."""
        return np.asarray(output)[: batch.rows]

    def stacked_local_rows(self, output, batch):
        """The real rows of a `[K, padded_rows, ...]` output, step after step."""
        rows = np.asarray(output)[:, : batch.rows]
        return rows.reshape((-1,) + rows.shape[2:])

    def any_process(self, flag):
        """`flag`: this process is every process."""
        return flag

    def any_reads(self, flag, sync):
        """`flag`: no other process needs to read the model."""
        return flag

    def stop_together(self, model, stop):
        """`stop`: this process's stop is every process's."""
        return stop

    def preparing(self, call="fit"):
        """A call's preparation: nothing to agree on. Yields the list of settings."""
        return contextlib.nullcontext([])

    def watch(self, call="fit"):
        """A call's span: no peer to watch."""
        return contextlib.nullcontext()

    def fit_settings(self, trainer, batches, **settings):
        """Nothing must agree."""
        return []

    def inference_settings(self, trainer, batches, **settings):
        """Nothing must agree."""
        return []

    def same_start(self, epoch, steps=0):
        """Every process starts where this one does."""

    def stop_mid_epoch(self, placed, epoch, index):
        """A stop is every process's."""

    def stop_mid_pass(self, placed, flag, index):
        """A stop is every process's."""

    def preemption(self, saving):
        """SIGTERM recorded for a save at the next step boundary; unwatched without a save.

        Without a checkpoint to write, SIGTERM keeps its default action and
        ends the process at once, rather than being recorded and never
        acted on.
        """
        return preemption_lib.Preemption() if saving else contextlib.nullcontext()

    def host_names(self):
        """No names: `describe` shows one process's devices."""
        return None


class ManyProcesses(batches_lib.GlobalBatches):
    """A mesh across processes: global batches, agreement rounds, peers watched.

    Every process must make the same trainers in the same order and call
    `steps`, `shard` and the agreement rounds alike (see
    `keras_dp.multihost.agreement`). `exchange` counts every host round
    trip (`exchange.rounds`).
    """

    whole_data = False
    compiles_ahead = False

    @property
    def primary(self):
        """Whether this is process 0, the one that prints and writes files."""
        return distributed.is_primary()

    def __init__(self, layout, prefetch=0):
        super().__init__(layout, prefetch)
        distributed.publish_host_name()  # for describe(), on any one process

    @property
    def reads_collectively(self):
        """Whether reading the state gathers it from every process: a state split across them."""
        return self.layout.state_sharding != "replicated"

    @property
    def before_gather(self):
        """The round every process makes before a read that gathers the state, or None."""
        return functools.partial(agreement.same_read, self) if self.reads_collectively else None

    def any_reads(self, flag, sync):
        """Whether any process must read the model; if so, process 0's model is synced first.

        Reading the model is a broadcast of process 0's in which every
        process takes part, so they decide together (one host round trip).
        """
        flag = self.any_process(flag)
        if flag:
            sync()  # process 0's model must hold its latest state
        return flag

    def stop_together(self, model, stop):
        """Whether training stops after this epoch on any process; then it stops on all.

        A callback that stops one process (an `EarlyStopping` on a value of
        its own) stops all, where the others would wait for it in the next
        step for ever: one round, and `model.stop_training` set to the answer.
        """
        model.stop_training = self.any_process(stop)
        return model.stop_training

    def preparing(self, call="fit"):
        """Run a call's preparation, then agree with every process (`agreement.preparing`)."""
        return agreement.preparing(self, call)

    def watch(self, call="fit"):
        """Post an error that leaves `call`, and end when a peer's does (`peers.watch`)."""
        return peers.watch(self, call)

    def fit_settings(self, trainer, batches, **settings):
        """What must be the same on every process in `fit` (`agreement.settings`)."""
        return agreement.settings(trainer, batches, **settings)

    def inference_settings(self, trainer, batches, **settings):
        """What must be the same on every process in `evaluate` and `predict`."""
        return agreement.inference_settings(trainer, batches, **settings)

    def same_start(self, epoch, steps=0):
        """Check that every process resumes at `epoch` after `steps` steps (`agreement.same_start`)."""
        agreement.same_start(self, epoch, steps)

    def stop_mid_epoch(self, placed, epoch, index):
        """A stop before the epoch's last batch must be every process's.

        A stop at the last batch needs nothing: every process goes on to
        the epoch's end, where they agree. Finding which it is places the
        next batch (if any), which the stop then drops.
        """
        if next(placed, None) is not None:
            agreement.stop_mid_epoch(self, epoch, index)

    def stop_mid_pass(self, placed, flag, index):
        """A stop of `evaluate` or `predict` before its last batch must be every process's."""
        if next(placed, None) is not None:
            agreement.stop_mid_pass(self, flag, index)

    def preemption(self, saving):
        """SIGTERM to any process, acted on by every one at the same step (`SyncedPreemption`).

        Across processes JAX's runtime takes SIGTERM: acted on, saved or not.
        """
        return SyncedPreemption()

    def host_names(self):
        """Every process's host name, by process index (`distributed.host_names`)."""
        return distributed.host_names()


class SyncedPreemption:
    """SIGTERM to any process, acted on by every process at the same step boundary.

    JAX's runtime catches SIGTERM in every process that joined it (its
    preemption notifier, installed by `jax.distributed.initialize`) and
    tells the coordination service. `requested` asks JAX's
    `multihost_utils.reached_preemption_sync_point`, which turns true in
    every process at the same call: one past the furthest any process had
    reached. So every process must read `requested` at the same points, as
    the trainer's loop does (before each compiled call and at each epoch's
    end). No Python handler is installed: it would replace JAX's.

    The step ids JAX is given keep growing across fits (`_SYNC_STEPS`): a
    SIGTERM between two fits sets the sync point one past the last id
    given, which a next fit counting from 0 again might never reach, and it
    would end without saving.
    """

    def __init__(self):
        self._reached = False

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        return None

    @property
    def requested(self):
        """Whether every process stops here (reading it is a sync-point step)."""
        if not self._reached and _preemption_service_enabled():
            from jax.experimental import multihost_utils

            self._reached = multihost_utils.reached_preemption_sync_point(next(_SYNC_STEPS))
        return self._reached

    def exit(self, directory, position):
        """Say where the run stopped and end the process as SIGTERM would (143)."""
        preemption_lib.exit_after_preemption(directory, position)


# The step ids of JAX's preemption sync point, for the whole process: JAX
# needs them increasing, and every process takes them at the same reads.
_SYNC_STEPS = itertools.count()


def _preemption_service_enabled():
    import jax

    return bool(jax.config.jax_enable_preemption_service)

