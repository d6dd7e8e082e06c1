"""What a checkpoint must match to resume mid-epoch: the plan of rows and the topology.

The rows each step of an epoch takes follow from the plan (`plan_of`: the
batch size, the rows, the shuffle, the steps per epoch) and, across
processes, from how the rows are shared (`topology_of`). A checkpoint
records both, and a position inside an epoch resumes only where they are
the same (`keras_dp.checkpoint.store.Checkpoints.restore`).
"""

import jax
import numpy as np

from keras_dp.checkpoint import integrity as guard
from keras_dp.sharding import batch_rows
from keras_dp.sources import grain as grain_source

SHUFFLE_CODES = {False: 0, True: 1, "batch": 2}


def plan_of(batches, shuffle, shares=False):
    """What decides which rows each step of an epoch takes, as ints (-1: unknown).

    `batch_size` (rows per step; for a dataset, its first batch's rows,
    without a Grain position), and, for array data, `rows` and `shuffle`;
    `steps` per epoch wherever known. Where the data is each process's
    share (`shares`: across processes) only `shuffle`: the others differ
    between processes with uneven shares, while the checkpoint holds one plan.
    """
    arrays = batches.arrays is not None
    steps = batches.steps if not shares else None
    if arrays and not shares:
        batch_size = batches.batch_size
    elif arrays or shares or batches.resumable is not None:
        batch_size = -1
    else:  # read already, by `fit`'s build
        batch_size = batch_rows(batches.peek())
    return {
        "batch_size": batch_size,
        "rows": batches.num_samples if arrays and not shares else -1,
        "steps": steps if isinstance(steps, int) else -1,
        "shuffle": SHUFFLE_CODES.get(shuffle, 1) if arrays else -1,
    }


def topology_of(mesh, batches):
    """The processes, `mesh`'s devices and the rows per step of a fit, as ints (-1: unknown).

    `local_batch` is process 0's rows per step: the batch size for array data
    (global / processes), a dataset's first batch otherwise.
    """
    if batches.arrays is not None:
        local = batches.batch_size
    elif batches.resumable is not None:  # a Grain position: not read yet
        local = -1
    else:
        local = batch_rows(batches.peek())
    return {"processes": jax.process_count(), "devices": int(mesh.devices.size),
            "local_batch": local}


def topology_words(topology, processes=None):
    """A `topology_of` dict in words: "2 processes of 2 devices each, a global batch of ..."."""
    processes = topology.get("processes", processes)
    devices = topology.get("devices", -1)
    words = f"{processes} process{'es' if processes != 1 else ''}"
    if devices > 0:
        each = devices // processes if devices % processes == 0 else None
        words += (f" of {each} device{'s' if each != 1 else ''}{' each' if processes > 1 else ''}"
                  if each else f" with {devices} devices in all")
    local = topology.get("local_batch", -1)
    if local > 0:
        words += (f", a global batch of {local * processes} rows ({local} on process 0)"
                  if processes > 1 else f", a batch of {local} rows")
    return words


def plan_words(name, value):
    """One entry of a `plan_of` dict in words: "batch_size=32", "60000 rows of training data"."""
    if name == "shuffle":
        return "shuffle=" + {code: repr(key) for key, code in SHUFFLE_CODES.items()}[value]
    return {"batch_size": f"batch_size={value}", "rows": f"{value} rows of training data",
            "steps": f"{value} steps per epoch"}[name]


def plan_tree(plan):
    """A `plan_of` (or `topology_of`) dict as int64 arrays, as a checkpoint stores it."""
    return {name: np.asarray(value, np.int64) for name, value in plan.items()}


def check_topology(tree, position, topology, directory, older_words):
    """Refuse a position within an epoch saved by another number of processes.

    Across processes each reads its own share of the data, so the rows
    that an epoch's first steps took depend on how many processes split
    it (and how each shuffled its share); a Grain position is each
    process's own. At an epoch's end without a Grain position the next
    epoch starts afresh on any number of processes and devices. Devices
    alone do not change which rows a step takes.
    """
    if topology is None or position.stopped:  # a stopped run trains nothing
        return
    saved = {name: int(value) for name, value in tree.get(guard.TOPOLOGY, {}).items()}
    held = guard.INPUT in tree and grain_source.holds_positions(tree[guard.INPUT])
    if guard.INPUT in tree:  # one row per process, also before the topology was saved
        saved.setdefault("processes", len(tree[guard.INPUT]))
    processes = saved.get("processes", topology["processes"])
    if processes == topology["processes"] or not (position.steps or held):
        return
    where = position.at() if position.steps else f"{position.at()} of a Grain stream"
    if position.steps:
        fix = (f"Resume on {processes} processes to finish that epoch (from its end, "
               "a run can go on with any number), or resume from the checkpoint kept "
               f"before it{older_words()}, or pass a new checkpoint_dir to start "
               "afresh.")
    else:
        fix = (f"Resume on {processes} processes, or pass a new checkpoint_dir to "
               "start afresh.")
    raise ValueError(
        f"The checkpoint in {directory} stopped {where}, written by "
        f"{topology_words(saved, processes)}, and this fit runs on "
        f"{topology_words(topology)}: each process's share of the data "
        f"{'and its Grain position ' if held else ''}would not be the one it "
        "left, so the rest of that epoch would train on other rows than the "
        f"interrupted run's (some twice, some never). {fix}")


def check_plan(tree, position, plan, directory):
    """Refuse a mid-epoch `position` saved under another plan than `plan`.

    At an epoch's end the next epoch starts afresh, so a new batch size
    or data there is a choice, not a mistake; mid-epoch, the steps done
    are counted in batches of the old plan.
    """
    if position.steps == 0 or plan is None or guard.PLAN not in tree:
        return
    saved = {name: int(value) for name, value in tree[guard.PLAN].items()}
    changed = [name for name, value in plan.items()
               if value != saved[name] and -1 not in (value, saved[name])]
    if {"batch_size", "rows"} & set(changed):  # steps per epoch follow from them
        changed = [name for name in changed if name != "steps"]
    if changed:
        was = ", ".join(plan_words(name, saved[name]) for name in changed)
        now = ", ".join(plan_words(name, plan[name]) for name in changed)
        raise ValueError(
            f"The checkpoint in {directory} stopped {position.at()} "
            f"of a fit with {was}, and this fit has {now}: the rest of that "
            "epoch would train on other rows than the interrupted run's. "
            "Rerun with the same data, batch_size and shuffle to finish that "
            "run, or pass a new checkpoint_dir to start afresh."
        )
