"""What a checkpoint must match to resume mid-epoch: the plan of rows and the topology.

The rows each step of an epoch takes follow from the plan (`plan_of`: the
batch size, the rows, the shuffle, the steps per epoch) and, where each
process reads a share of its own, from how the rows are shared
(`topology_of`). A checkpoint records both, and a position inside an epoch
resumes only where the plan is the same and the rows of its steps are too
(`keras_dp.checkpoint.store.Checkpoints.restore`): on any number of
processes and devices where the order is global (`ORDERS`: the same arrays
on every process, or Grain's `ElasticIterator`), else on as many processes.
"""

import jax
import numpy as np

from keras_dp.checkpoint import integrity as guard
from keras_dp.sharding import batch_rows
from keras_dp.sources import grain as grain_source

SHUFFLE_CODES = {False: 0, True: 1, "batch": 2}
# A source's `global_order` as a checkpoint stores it: 0, each process's own
# order (shares, a dataset sharded per process); else a global order, which
# is a function of the seed, the epoch and the step alone, the same for any
# number of processes: arrays read as one process reads them, or a Grain
# `ElasticIterator`, whose position counts global rows.
ORDERS = {None: 0, "arrays": 1, "grain elastic": 2}


def plan_of(batches, shuffle, shares=False):
    """What decides which rows each step of an epoch takes, as ints (-1: unknown).

    `batch_size` (rows per step; for a dataset, its first batch's rows,
    without a Grain position; a Grain `ElasticIterator`'s global batch), and,
    for array data, `rows` and `shuffle`; `steps` per epoch wherever known.
    Where the data is each process's share (`shares`: across processes,
    unless the source's order is global) only `shuffle`: the others differ
    between processes with uneven shares, while the checkpoint holds one plan.
    """
    arrays = batches.arrays is not None
    shares = shares and batches.global_order is None
    steps = batches.steps if not shares else None
    if arrays and not shares:
        batch_size = batches.batch_size
    elif batches.global_batch_size is not None:  # a Grain ElasticIterator's
        batch_size = batches.global_batch_size
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
    """The processes, `mesh`'s devices, the rows per step and the order of a fit, as ints (-1: unknown).

    `local_batch` is process 0's rows per step: the batch size for array data
    (global / processes), a dataset's first batch otherwise. `order`: the
    source's `global_order` as `ORDERS` codes it.
    """
    processes = jax.process_count()
    if batches.arrays is not None:
        local = batches.batch_size // (processes if batches.part else 1)
    elif batches.resumable is not None:  # a Grain position: not read yet
        local = -1
    else:
        local = batch_rows(batches.peek())
    return {"processes": processes, "devices": int(mesh.devices.size),
            "local_batch": local, "order": ORDERS[batches.global_order]}


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
    """Refuse a position within an epoch whose rows this fit's steps would not take.

    Where the order is global (`ORDERS`), the rows of an epoch's steps are
    a function of the seed, the epoch and the step alone: a position inside
    an epoch resumes on any number of processes and devices, with the same
    kind of source. Where each process reads a share of its own (and
    shuffles it with an order of its own), the rows of the epoch's first
    steps depend on how many processes split it, and a Grain position is
    each process's own: such a position resumes only on as many processes,
    with the same kind of order. At an epoch's end without a Grain position
    the next epoch starts afresh on any number of processes and devices.
    Devices alone never change which rows a step takes.
    """
    if topology is None or position.stopped:  # a stopped run trains nothing
        return
    saved = {name: int(value) for name, value in tree.get(guard.TOPOLOGY, {}).items()}
    held = guard.INPUT in tree and grain_source.holds_positions(tree[guard.INPUT])
    if guard.INPUT in tree:  # one row per process, also before the topology was saved
        saved.setdefault("processes", len(tree[guard.INPUT]))
    processes = saved.get("processes", topology["processes"])
    if not (position.steps or held):
        return
    order = saved.get("order", _order_before(tree, processes, held))
    if order == topology["order"] and (order or processes == topology["processes"]):
        return
    raise ValueError(_refusal(saved, processes, order, topology, position, held, directory,
                              older_words))


def _order_before(tree, processes, held):
    """The order of a checkpoint from before orders were saved: global for one process's arrays."""
    arrays = int(tree.get(guard.PLAN, {}).get("rows", -1)) != -1
    return ORDERS["arrays"] if processes == 1 and arrays and not held else 0


def _refusal(saved, processes, order, topology, position, held, directory, older_words):
    """Why a position inside an epoch is refused (`check_topology`), with the fix."""
    where = position.at() if position.steps else f"{position.at()} of a Grain stream"
    if order != topology["order"] and processes == topology["processes"]:
        return (
            f"The checkpoint in {directory} stopped {where}, and its training rows were "
            f"{_ORDER_WORDS[order]}, where this fit's are {_ORDER_WORDS[topology['order']]}: "
            "the rest of that epoch would train on other rows than the interrupted run's. "
            "Pass the data as that run did to finish the epoch, or pass a new "
            "checkpoint_dir to start afresh.")
    if position.steps:
        fix = (f"Resume on {processes} processes to finish that epoch (from its end, "
               "a run can go on with any number), or resume from the checkpoint kept "
               f"before it{older_words()}, or pass a new checkpoint_dir to start "
               "afresh.")
    else:
        fix = (f"Resume on {processes} processes, or pass a new checkpoint_dir to "
               "start afresh.")
    return (
        f"The checkpoint in {directory} stopped {where}, written by "
        f"{topology_words(saved, processes)}, and this fit runs on "
        f"{topology_words(topology)}: each process's share of the data "
        f"{'and its Grain position ' if held else ''}would not be the one it "
        "left, so the rest of that epoch would train on other rows than the "
        f"interrupted run's (some twice, some never). {fix} To resume inside an epoch "
        "on any number of processes, pass the same whole arrays on every process "
        "(keras_dp takes each process's part of every global batch), or read Grain "
        "through grain.experimental.ElasticIterator (see the docs: guides/preemption).")


_ORDER_WORDS = {
    0: "each process's share, in an order of its own (or a dataset)",
    1: "the same whole arrays on every process, in one global order",
    2: "a Grain ElasticIterator's, in one global order",
}


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
