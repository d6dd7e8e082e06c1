"""Checkpoints of the whole training state, and saving on preemption.

A checkpoint holds every variable a train step reads, taken from the live
training state on the devices: the trainable and non-trainable variables
(BatchNorm statistics, Dropout's seed-generator state), the optimizer's
variables (step count, slots, learning rate, loss scale), the metrics'
running totals, and the position in the run: the epoch in progress and how
many of its steps are done. The shuffle order of an epoch is a function of
the trainer's seed and the epoch index, so this is all a resumed run needs
to take the same steps on the same rows as an unbroken one, and end with
bitwise the same weights on CPU.

Written with orbax-checkpoint, JAX's checkpoint library, rather than Keras
saving: Keras saving stores a model and its optimizer but not the metrics'
state, and orbax gives the guarantee a resume needs. Each save goes to a
temporary directory that is renamed into place only once complete, so a
crash or a kill in the middle of a write leaves the previous checkpoint the
latest one, never a partial one. Orbax is imported only when a checkpoint is
used.

Who writes what: the state's `jax.Array`s go to orbax as they lie
(`state_sharding`); each shard is written once, by the process whose
device holds it (a replicated array by process 0), so nothing is gathered
to be saved. Process 0 writes the position, the checksums (computed on the
devices: `checkpoint_guard.bitsums`) and the metadata, and commits once
every process has finished (orbax's multi-process protocol): a checkpoint
is complete for all or absent for all. A restore reads each array into
the layout asked for (orbax reshards on load), so a checkpoint of `"full"`
on 4 devices resumes `"replicated"` on 2; `fit` reads it into the Keras
model's variables, which it then lays out anew.

Across processes, every process takes part in each save and restore, and
`checkpoint_dir` must be one directory every process sees (a shared
filesystem). When to save on SIGTERM is `keras_dp.checkpoint.preemption`'s business.
"""

import contextlib
import errno
import logging
import os

import jax
import numpy as np

from keras_dp import liveness
from keras_dp import options
from keras_dp.checkpoint import integrity as guard
from keras_dp.checkpoint import plan as plan_lib
from keras_dp.core.live import Deferred
from keras_dp.core.live import Position
from keras_dp.core.state import TrainState
from keras_dp.core.state import write_back

# Raised by this module's restore and save too: users catch them from here.
DamagedCheckpointError = guard.DamagedCheckpointError
DirectoryInUseError = guard.DirectoryInUseError


class Checkpoints:
    """The checkpoints of one run in `directory`; the newest `max_to_keep` are kept.

    Args:
        directory: where to write; created if missing. Use one directory per
            run: a checkpoint of another model cannot be restored.
        max_to_keep: how many of the newest checkpoints to keep.
        lock: hold `directory` for this run until `close` (see
            `keras_dp.checkpoint.integrity`); across processes, process 0 locks.
        source: an input whose position is saved with the state and set
            on restore (`keras_dp.sources.grain.GrainEpochs`), or None.
        plan: what decides which rows each step of an epoch takes (`plan.plan_of`),
            saved with the state; a checkpoint taken mid-epoch resumes only
            under the same plan. None: not saved, not checked.
        topology: the processes, devices and rows per step of this run
            (`plan.topology_of`), saved with the state; a checkpoint that holds a
            position within an epoch or a Grain stream resumes only on the
            same number of processes. None: not saved, not checked.

    Raises:
        DirectoryInUseError: with `lock`, another live run holds `directory`.
    """

    def __init__(self, directory, max_to_keep=2, lock=True, source=None, plan=None,
                 topology=None):
        import orbax.checkpoint as ocp

        self.source, self.plan, self.topology = source, plan, topology
        self.optimizer = None  # its name, saved and checked (`checkpoint_guard.optimizer_name`)
        self.variables = None  # the model's, saved and checked (`checkpoint_guard.variable_signatures`)
        self.restored = None  # the `Position` restored by `restore`, if any

        self._ocp = ocp
        self.directory = options.check_dir(directory, "checkpoint_dir")
        self.max_to_keep = max_to_keep
        self._lock = guard.DirectoryLock(self.directory) if lock else None
        try:
            self._manager = _manager_class(ocp)(
                self.directory,
                options=ocp.CheckpointManagerOptions(
                    max_to_keep=max_to_keep, create=True,
                    # Synchronous: when save returns, the checkpoint is complete.
                    enable_async_checkpointing=False,
                ),
                # Named, so that a fresh manager can read a checkpoint's metadata.
                item_handlers=ocp.StandardCheckpointHandler(),
            )
        except BaseException:
            if self._lock is not None:  # else this process would hold it for good
                self._lock.release()
            raise

    def save(self, state, position, seed):
        """Write `state` and `position`; returns when the checkpoint is complete.

        `state` is a `TrainState` of `jax.Array`s, laid out as they lie
        (see the module docstring for who writes what: nothing is
        gathered). A checksum of every array (`checkpoint_guard.bitsums`)
        is written with it, checked on restore. Across processes, every
        process must call this at the same point. Ctrl-C waits for the save
        to complete and acts after it (`keras_dp.core.live.Deferred`).
        """
        # Ctrl-C waits for the save to complete: a KeyboardInterrupt inside
        # orbax's write dropped the checkpoint, and one in its cleanup left
        # more than max_to_keep.
        with Deferred() as deferred, deferred.held():
            index = self._manager.latest_step()
            index = 0 if index is None else index + 1
            tree = self._tree(state, position, seed)
            try:
                with _orbax_errors_held():
                    self._manager.save(index, args=self._ocp.args.StandardSave(tree), force=True)
                    self._manager.wait_until_finished()
                liveness.note_checkpoint(self.directory, index, position.at())
            except Exception as error:  # noqa: BLE001 - one clear error, not orbax's chain
                failed = (f"Saving the checkpoint {_of(position)} in {self.directory} failed "
                          f"({guard.short(error)}). The model holds the weights it trained; "
                          "the newest complete checkpoint there is unchanged.")
                code = getattr(error, "errno", None)
                if isinstance(error, OSError) or code:
                    raise OSError(code or errno.EIO,
                                  f"{failed} Free space or fix the directory, then rerun the "
                                  "same fit to resume.") from None
                # Not the disk's or the directory's, as far as the error says: its
                # chain stays, for what orbax or TensorStore reports.
                raise RuntimeError(
                    f"{failed} If the disk or the directory is at fault, fix it and "
                    "rerun the same fit to resume.") from error

    def _tree(self, state, position, seed):
        """What `save` writes: the state, the position and what resuming checks, with checksums."""
        tree = self._template(state, position, seed)
        if position.stopped:
            tree[guard.STOPPED] = {"stopped": np.asarray(1, np.int64)}
        if self.optimizer is not None:
            tree[guard.OPTIMIZER] = guard.optimizer_tree(self.optimizer)
        if self.variables is not None:
            tree[guard.VARIABLES] = guard.variables_tree(self.variables)
        tree[guard.SUMS] = guard.bitsums(tree)
        return tree

    def _template(self, state, position=None, seed=0):
        """A checkpoint's tree without checksums: `state` at `position`, and where the run stands.

        With no `position`, what a restore reads into: `state` is an
        `abstract_state`, and the input's position its `template`.
        """
        at = (0, 0) if position is None else (position.epoch, position.steps)
        tree = {"state": dict(state._asdict()), "position": _position_tree(*at, seed)}
        if self.source is not None:  # where the input stands, per process
            tree[guard.INPUT] = (self.source.template() if position is None
                                 else self.source.saved(position))
        if self.plan is not None:
            tree[guard.PLAN] = plan_lib.plan_tree(self.plan)
        if self.topology is not None:
            tree[guard.TOPOLOGY] = plan_lib.plan_tree(self.topology)
        return tree

    def save_live(self, live, trainer, position):
        """Save the state a fit has reached (`LiveModel.current`) at `position`.

        The live state as it lies, or the model's if a callback changed it.
        """
        self.save(live.current(trainer.init_state, trainer.hosts), position, trainer.seed)

    def check_room(self, model):
        """Raise `OSError` if the directory's filesystem cannot take the checkpoints to come."""
        leaves = guard.leaves(self._template(abstract_state(model)))
        nbytes = sum(leaf.size * np.dtype(leaf.dtype).itemsize for _, leaf in leaves)
        kept = len(self._manager.all_steps())
        guard.check_room(self.directory, nbytes + 8 * len(leaves),
                         max(1, self.max_to_keep + 1 - kept))

    def restore(self, model, seed):
        """Load the newest intact checkpoint into `model`; return its `Position` or None.

        The arrays are read straight onto the devices of the model's
        variables, each device reading its shard, and assigned as read, with
        no copy: a device holds at most its shards of the old state and the
        new. See `restore_state` for what is checked and raised.
        """
        state, position = self.restore_state(abstract_state(model), seed)
        if state is not None:
            write_back(state, model, owned=True)
        self.restored = position
        return position

    def resume_note(self, epochs):
        """One line saying where a fit of `epochs` epochs resumes, or that it has nothing to do.

        None if nothing was restored.
        """
        position = self.restored
        if position is None:
            return None
        at = position.at()
        if position.stopped:
            return (f"keras_dp: the run in {self.directory} stopped early, {at} "
                    "(a callback set model.stop_training, e.g. EarlyStopping): nothing "
                    "is left to train, and the model holds the weights that run ended "
                    "with. Pass a new checkpoint_dir to train again.")
        if position.epoch >= epochs:
            return (f"keras_dp: the checkpoint in {self.directory} is {at}, and "
                    f"epochs={epochs}: nothing is left to train, and the model holds "
                    "the checkpoint's weights. Pass a larger epochs to train on, or a "
                    "new checkpoint_dir to start afresh.")
        return f"keras_dp: resuming from the checkpoint in {self.directory}, {at}."

    def restore_state(self, abstract, seed):
        """The newest intact checkpoint's state, laid out as `abstract`, and its `Position`.

        `abstract` is a `TrainState` of `jax.ShapeDtypeStruct`s with
        shardings (`abstract_state`): each process reads only the shards
        its devices hold, whatever layout wrote them. Returns `(None, None)`
        when the directory holds no checkpoint.

        A damaged checkpoint is skipped with a warning for the next older
        one (`checkpoint_guard.newest_intact`).

        Raises:
            ValueError: the newest readable checkpoint does not fit the model
                (another model, optimizer or metrics wrote it: its arrays'
                names or shapes differ, or its optimizer's class, or what
                each weight is: `checkpoint_guard.check_variables`), or
                another seed wrote it, whose shuffle order would make the
                resumed run differ, or it was taken mid-epoch under another
                plan (`plan.plan_of`: batch size, rows, steps per epoch,
                shuffle), so the rest of the epoch would take other rows.
                Or it holds a position within an epoch (or a Grain stream's,
                at any point) and another number of processes wrote it: each
                process's share of the data, and its Grain position, would
                not be the ones it left.
            DamagedCheckpointError: every checkpoint in the directory is damaged.
        """
        template = self._template(abstract)
        if self.optimizer is not None:
            template[guard.OPTIMIZER] = guard.optimizer_tree(self.optimizer)
        tree, index = guard.newest_intact(self._manager, template,
                                          self._ocp.args.StandardRestore)
        if tree is None:
            return None, None
        guard.check_optimizer(tree, self.optimizer, self.directory)
        guard.check_variables(tree, self.variables, self.directory)
        self._check_seed(tree, seed)
        position = Position(int(tree["position"]["epoch"]), int(tree["position"]["steps"]),
                            stopped=guard.STOPPED in tree)
        plan_lib.check_topology(tree, position, self.topology, self.directory, self._older_words)
        plan_lib.check_plan(tree, position, self.plan, self.directory)
        if self.source is not None:
            self.source.restore(position, tree[guard.INPUT])
        liveness.note_checkpoint(self.directory, index, position.at())
        return TrainState(**tree["state"]), position

    def _check_seed(self, tree, seed):
        saved_seed = int(tree["position"]["seed"])
        if saved_seed != seed:
            raise ValueError(
                f"The checkpoint in {self.directory} was written by a run with "
                f"seed={saved_seed}, and this trainer has seed={seed}: the "
                "shuffle order would differ from the interrupted run. Pass "
                f"seed={saved_seed} to resume it, or a new checkpoint_dir."
            )

    def _older_words(self):
        """How to resume from the checkpoint before the newest one, if one is kept."""
        steps = sorted(self._manager.all_steps())
        if len(steps) < 2:
            return " (none is kept here)"
        newest = os.path.join(self.directory, str(steps[-1]))
        return (f" (delete {newest}, which was written mid-epoch, and rerun: "
                f"{os.path.join(self.directory, str(steps[-2]))} is then resumed, the end "
                "of the epoch before if the run was stopped once in that epoch)")

    def close(self):
        """Release the checkpoint manager (its threads and file handles) and the lock.

        Calling it again does nothing.
        """
        if self._manager is not None:
            self._manager.close()
            self._manager = None
        if self._lock is not None:
            self._lock.release()


@contextlib.contextmanager
def _orbax_errors_held():
    """Hold orbax's error logs while a save runs: passed on if it succeeds, dropped if not.

    A write that fails in one of orbax's threads (a full disk under its
    metadata) is logged there with its whole traceback, through absl,
    before the save raises it; `Checkpoints.save` then raises one `OSError`
    naming the checkpoint and the cause, so the traceback only buries it.
    """
    records = []

    def held(record):  # a logging filter: keeps orbax's error records aside
        if record.levelno >= logging.ERROR and "orbax" in record.pathname:
            records.append(record)
            return False
        return True

    logger = logging.getLogger("absl")
    logger.addFilter(held)
    try:
        yield
    finally:
        logger.removeFilter(held)
    for record in records:  # the save succeeded: nothing explains them
        logger.handle(record)


@contextlib.contextmanager
def closing(checkpoints):
    """Close `checkpoints` (a `Checkpoints`, or None) when the block ends, however."""
    try:
        yield checkpoints
    finally:
        if checkpoints is not None:
            checkpoints.close()


def open_for_fit(checkpoint_dir, model, seed, initial_epoch,
                 steps_per_epoch=None, source=None, plan=None, max_to_keep=2, topology=None):
    """The `Checkpoints` of a fit and where it starts: `(checkpoints, Position)`.

    Without `checkpoint_dir`: `(None, Position(initial_epoch, 0))`. With one
    that holds a checkpoint, the model is restored from the newest and its
    position replaces `initial_epoch`.

    Across processes, every process must call this with
    the same `checkpoint_dir`, on a filesystem they share; each restores the
    same newest checkpoint. A `source` (see `Checkpoints`) has its position
    saved with each checkpoint and restored from it; a `plan` (`plan.plan_of`)
    is saved with each, and a mid-epoch checkpoint of another plan refused;
    so is a `topology` (`plan.topology_of`), and a checkpoint that holds a position
    within an epoch refused on another number of processes. The newest `max_to_keep` checkpoints are kept.

    The caller must `close` the `Checkpoints` (see `closing`): until then
    it holds the directory's lock. On an error here it is closed already.

    Raises:
        ValueError: `checkpoint_dir` with `steps_per_epoch` and no `source`, or a checkpoint
            that does not fit (see `Checkpoints.restore`).
        DirectoryInUseError: another live run holds `checkpoint_dir`.
        OSError: its filesystem has no room for the checkpoints to come.
    """
    start = Position(initial_epoch, 0)
    if checkpoint_dir is None:
        return None, start
    if steps_per_epoch is not None and source is None:
        raise ValueError(
            "checkpoint_dir combines with steps_per_epoch only for a Grain "
            "source: epochs of a fixed length draw from one continuing stream, "
            "and a checkpoint records the stream's position only for Grain, so "
            "a resumed run would train on other batches than an unbroken one. "
            "Drop steps_per_epoch (an epoch is then one pass over the data), "
            "drop checkpoint_dir, or read the data through Grain."
        )
    # orbax's save and restore take part in every process alike; the lock
    # is process 0's, for all of them.
    checkpoints = Checkpoints(checkpoint_dir, lock=jax.process_index() == 0,
                              source=source, plan=plan, max_to_keep=max_to_keep,
                              topology=topology)
    checkpoints.optimizer = guard.optimizer_name(model.optimizer)
    checkpoints.variables = guard.variable_signatures(model)
    if source is not None:
        source.recording = True
    with contextlib.ExitStack() as on_error:
        on_error.callback(checkpoints.close)
        guard.check_writable(checkpoints.directory)
        position = checkpoints.restore(model, seed) or start
        checkpoints.check_room(model)
        on_error.pop_all()
    return checkpoints, position


def _of(position):
    """`position.at()` after "the checkpoint": "of the end of epoch 2", "after 5 steps ..."."""
    return f"of the end of epoch {position.epoch}" if position.steps == 0 else position.at()


def _manager_class(ocp):
    """orbax's `CheckpointManager`, minus its own look at JAX's preemption sync point.

    keras_dp decides when to save on SIGTERM (`keras_dp.checkpoint.preemption`). orbax's
    `save` also asks `reached_preemption_sync_point`, with its checkpoint
    index as the step; JAX's sync point is reached by one call only, so when
    orbax's call took it, keras_dp's own calls never saw it and a preempted
    run trained on to the end and exited 0 (the 2-process SIGTERM test
    failed so, now and then). `tests/test_checkpoint.py` checks that a save
    no longer asks.
    """

    class Manager(ocp.CheckpointManager):
        def reached_preemption(self, step):
            return False

    return Manager


def abstract_state(model, shardings=None):
    """`model`'s training state as `jax.ShapeDtypeStruct`s: what a restore reads into.

    `shardings` is a `TrainState` of shardings (`keras_dp.sharding`, e.g. a
    trainer's `state_layout()`); default: where each Keras variable lies.
    """
    if shardings is None:
        shardings = TrainState(*([v.value.sharding for v in group]
                                 for group in TrainState.variables_of(model)))
    return TrainState.abstract_of(model, shardings)


def _position_tree(epoch, steps, seed):
    return {"epoch": np.asarray(epoch), "steps": np.asarray(steps), "seed": np.asarray(seed)}

