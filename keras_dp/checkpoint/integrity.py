"""What makes a checkpoint trustworthy: one writer, room to write, a checksum per array.

Two runs saving into one directory would race on the next checkpoint's
index and delete each other's files, so a fit holds an exclusive lock on
`.keras_dp.lock` in the directory from opening it to its end. The lock is
the kernel's (`fcntl.flock`), so it goes when its holder's process dies,
however it dies: a lock file left by a killed run is simply taken over.
The file records the holder's pid and host, for the message a second run
gets. Across the processes of one multi-process run, process 0 takes it
for all (they share the run).

Room is checked before the first step from the state's size, so a full
disk is reported at second 0 rather than as a failed save after an epoch.

Every array saved has a checksum of its bits saved with it (`bitsums`),
checked on restore, so a damaged file is told apart from a checkpoint of
another model (whose arrays' names, shapes or dtypes differ: `layout`).
The checksum is computed where the array lies, by one compiled function,
and is the same however the array is split over devices and processes: a
save never gathers an array to check it, and a checkpoint written split
over 4 devices verifies when read onto 2, or onto 1 process of 2. An older
checkpoint holding CRC-32s (keras_dp before this checksum) is verified by
its CRC-32s, on the host. The optimizer's class name is saved too and
compared (`check_optimizer`): two optimizers' slots can have the same shapes.
So is what each model variable is, its layer's class and its own name
(`variable_signatures`, compared by `check_variables`): two models can hold
arrays of the same shapes in another arrangement. Hyperparameters (the
learning rate, say) are not compared: resuming with new ones is a choice.
"""

import errno
import fcntl
import os
import shutil
import socket
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from keras_dp import _compat
from keras_dp import _messages

SUMS = "bitsums"  # the key of this keras_dp's checksums (`bitsums`)
LEGACY_SUMS = "checksums"  # CRC-32s of each array's bytes, written before
_SUM_DTYPES = {SUMS: np.uint32, LEGACY_SUMS: np.int64}
PLAN = "plan"  # the rows-per-step plan of a fit (`checkpoint.plan_of`), absent before it was added
# The processes, devices and rows per step that wrote a checkpoint
# (`checkpoint.topology_of`), absent before it was added.
TOPOLOGY = "topology"
# A Grain source's position, one row per process of the run that wrote it:
# read with the rows it has, whatever this run's process count.
INPUT = "input"
# Present only in the checkpoints of a run that `stop_training` ended
# (`checkpoint.Position.stopped`); a reader's template never holds it: read along.
STOPPED = "stopped"
# The optimizer's class name (`optimizer_name`), absent before it was added.
OPTIMIZER = "optimizer"
_NAME_BYTES = 64
# Each model variable's "Layer/name shape dtype" (`variable_signatures`),
# absent before it was added. Its length varies with the model, so a
# reader's template never holds it: it is read along and compared.
VARIABLES = "variables"
LOCK_FILE = ".keras_dp.lock"
# orbax's metadata files beside the arrays: a few KiB per checkpoint.
_OVERHEAD_BYTES = 64 * 1024


class DamagedCheckpointError(ValueError):
    """Every checkpoint in a directory is damaged (unreadable, or not its checksums)."""


class DirectoryInUseError(RuntimeError):
    """Another live process is writing checkpoints into the same directory."""


class DirectoryLock:
    """An exclusive hold on `directory` (created if missing) until `release`.

    Raises:
        DirectoryInUseError: a live process holds it; the message names its
            pid and host.
    """

    def __init__(self, directory):
        self.path = os.path.join(directory, LOCK_FILE)
        try:
            os.makedirs(directory, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:  # a file there, no permission, a read-only disk
            raise type(error)(error.errno, (
                f"checkpoint_dir {directory} cannot be used ({error.strerror}): it "
                "must be a directory this process can create and write to. Pass "
                "another path."), error.filename) from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            holder = os.pread(self._fd, 200, 0).decode(errors="replace").strip()
            self._close()
            if error.errno not in (errno.EAGAIN, errno.EACCES):
                # A filesystem without locks: say so, and go on unguarded.
                _messages.warn(
                    f"keras_dp: cannot lock {directory} ({error.strerror}); "
                    "make sure no other run writes checkpoints there.",
                    RuntimeWarning)
                return
            raise DirectoryInUseError(
                f"checkpoint_dir {directory} is in use by another run "
                f"({holder or 'holder unknown'}): two runs saving into one "
                "directory would overwrite each other's checkpoints. Wait for "
                "that run to end, or stop it, or pass another checkpoint_dir."
            ) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)

    def release(self):
        """Give the directory up (idempotent); the lock file stays, unlocked."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            self._close()

    def _close(self):
        os.close(self._fd)
        self._fd = None


def check_writable(directory):
    """Raise `PermissionError` if this process cannot write into `directory`.

    A lock file left there by an earlier run opens for writing even when
    the directory itself is read-only; without this, a fit would train an
    epoch and fail at its save.
    """
    if not os.access(directory, os.W_OK | os.X_OK):
        raise PermissionError(
            errno.EACCES,
            f"checkpoint_dir {directory} cannot be written to (Permission denied): "
            "the first save, at the end of an epoch, would fail. It must be a "
            "directory this process can write to: fix its permissions (chmod u+w), "
            "or pass another path.")


def optimizer_name(optimizer):
    """`optimizer`'s class name, with its inner optimizer's for a wrapper: "LossScaleOptimizer(Adam)"."""
    inner = getattr(optimizer, "inner_optimizer", None)
    name = type(optimizer).__name__
    return name if inner is None else f"{name}({optimizer_name(inner)})"


def optimizer_tree(name):
    """A checkpoint's entry for optimizer `name`: its bytes, zero-padded to a fixed size."""
    data = name.encode()[:_NAME_BYTES].ljust(_NAME_BYTES, b"\0")
    return {"name": np.frombuffer(data, np.uint8).copy()}


def check_optimizer(tree, name, directory):
    """Refuse a checkpoint `tree` written with another optimizer than `name` (None: unchecked).

    Its variables can have the same shapes (SGD's momentum, RMSprop's
    velocity): restored, RMSprop would take a negative momentum for a mean
    square and train on NaN.
    """
    if name is None or OPTIMIZER not in tree:  # an older keras_dp's checkpoint
        return
    saved = bytes(np.asarray(tree[OPTIMIZER]["name"])).rstrip(b"\0").decode()
    if saved != name:
        raise ValueError(
            f"The checkpoint in {directory} was written with the optimizer {saved}, "
            f"and this model's is {name}: its slots would be restored into the wrong "
            f"optimizer. Compile with {saved} to resume that run, or pass a new "
            "checkpoint_dir to start afresh.")


def variable_signatures(model):
    """What each trainable, then non-trainable, variable of `model` is: "Dense/kernel (4, 8) float32".

    The class of the layer that owns it and its own name, not its path:
    Keras numbers auto-named layers per process (`dense_3`), so paths differ
    between two runs of one script, while arrays of the same shapes in
    another arrangement (an Embedding's table where a Dense kernel was)
    differ here.
    """
    owners = {}
    for layer in _compat.all_layers(model):  # outer layers first: the innermost owner wins
        for variable in layer.variables:  # with its seed generators' states
            owners[id(variable)] = type(layer).__name__
    return [f"{owners.get(id(variable), type(model).__name__)}/{variable.name} "
            f"{tuple(variable.shape)} {np.dtype(variable.dtype).name}"
            for variable in [*model.trainable_variables, *model.non_trainable_variables]]


def variables_tree(signatures):
    """A checkpoint's entry for `variable_signatures`: their lines as UTF-8 bytes."""
    text = "\n".join(["keras_dp variables 1", *signatures]).encode()
    return {"lines": np.frombuffer(text, np.uint8).copy()}


def check_variables(tree, signatures, directory):
    """Refuse a checkpoint `tree` of variables other than `signatures` (None: unchecked).

    Names the first variable that differs. A checkpoint of a keras_dp from
    before the signatures were saved is not checked.
    """
    if signatures is None or VARIABLES not in tree:
        return
    saved = bytes(np.asarray(tree[VARIABLES]["lines"])).decode().split("\n")[1:]
    if saved == signatures:
        return
    index = next((i for i, (a, b) in enumerate(zip(saved, signatures)) if a != b),
                 min(len(saved), len(signatures)))
    there, here = (lines[index] if index < len(lines) else "absent"
                   for lines in (saved, signatures))
    raise ValueError(
        f"The checkpoint in {directory} was written for another model: its arrays fit "
        f"this model's shapes, but weight {index} (trainable weights first, as layer "
        f"class/name, shape, dtype) is {there} there and {here} here, so the arrays "
        "would be restored into the wrong layers. Resume with the model that wrote "
        "it, or pass a new checkpoint_dir to start afresh.")


def check_room(directory, checkpoint_bytes, checkpoints_to_add):
    """Raise `OSError` (ENOSPC) if `directory` lacks room for the checkpoints to come.

    `checkpoints_to_add` checkpoints of `checkpoint_bytes` each (plus a
    little metadata) must fit in the free space of the filesystem holding
    `directory`, read with `shutil.disk_usage`.
    """
    need = checkpoints_to_add * (checkpoint_bytes + _OVERHEAD_BYTES)
    free = shutil.disk_usage(directory).free
    if free < need:
        raise OSError(
            errno.ENOSPC,
            f"Not enough free space for checkpoints in {directory}: "
            f"{_mib(free)} free, and this fit needs {_mib(need)} "
            f"({checkpoints_to_add} more checkpoints of {_mib(checkpoint_bytes)} "
            "each: the kept ones and the next, written before the oldest is "
            "removed). Free some space, or pass a checkpoint_dir on a larger "
            "filesystem.")


def _mib(nbytes):
    return f"{nbytes / 2**20:,.2f} MiB"


def newest_intact(manager, template, restore_args):
    """`(tree, index)` of the newest intact checkpoint of an orbax `manager`; `(None, None)` if none.

    A checkpoint that cannot be read, or whose values differ from the
    checksums written with them (a damaged or truncated file), is skipped
    with a `RuntimeWarning` naming it and what was wrong, and the next
    older one is tried. See `read_verified` for the arguments.

    Raises:
        ValueError: the newest readable checkpoint does not fit `template`.
        DamagedCheckpointError: every checkpoint of `manager` is damaged.
    """
    directory, damaged = str(manager.directory), []
    for index in sorted(manager.all_steps(), reverse=True):
        problem, tree = read_verified(manager, index, template, restore_args)
        if problem is None:
            break
        damaged.append(f"{os.path.join(directory, str(index))}: {problem}")
    else:
        if damaged:
            raise DamagedCheckpointError(
                f"Every checkpoint in {directory} is damaged, so there is "
                "nothing to resume from: " + "; ".join(damaged) + ". Restore the "
                "directory from a copy, or pass a new checkpoint_dir to start afresh.")
        return None, None
    if damaged:
        _messages.warn(
            "keras_dp: skipped damaged checkpoints (" + "; ".join(damaged)
            + f"); resuming from the older intact one, {index}.",
            RuntimeWarning)
    return tree, index


def read_verified(manager, index, template, restore_args):
    """Checkpoint `index` of an orbax `manager`: `(None, tree)` if intact, else `(what is wrong, None)`.

    `template` is the tree to restore into, without checksums (see
    `keras_dp.checkpoint.store`), and `restore_args` orbax's `StandardRestore`.
    The checksums the checkpoint holds are read too and checked: this
    keras_dp's (`bitsums`, on the devices), or an older one's CRC-32s (on
    the host). A checkpoint written without checksums is restored with a
    warning that it is unchecked.

    Raises:
        ValueError: the checkpoint is readable but does not fit `template`
            (its arrays' names, shapes or dtypes differ).
    """
    path = os.path.join(str(manager.directory), str(index))
    try:
        saved = manager.item_metadata(index).tree
    except Exception as error:  # noqa: BLE001 - any read error means damaged
        if not os.path.isdir(os.path.join(path, "default")):  # orbax's item: nothing saved
            return ("it holds no saved state (a save cut short, or a copy of one: "
                    "delete it)"), None
        return f"its metadata could not be read ({short(error)})", None
    for key in (PLAN, OPTIMIZER, TOPOLOGY):  # an older keras_dp's: nothing to check
        if key in template and key not in saved:
            template = {name: value for name, value in template.items() if name != key}
    if INPUT in template and len(getattr(saved.get(INPUT), "shape", ())) == 2:
        # One row per saving process; `checkpoint.Checkpoints` checks the count.
        template = dict(template, **{INPUT: np.zeros(saved[INPUT].shape,
                                                      np.dtype(saved[INPUT].dtype))})
    for key in (PLAN, STOPPED, OPTIMIZER, VARIABLES, TOPOLOGY):
        # Read along an entry that a reader checks none of, and the entries of a plan
        # or topology that it has: an older keras_dp's has fewer.
        if key in saved and (key not in template or (
                key in (PLAN, TOPOLOGY) and set(saved[key]) != set(template[key]))):
            template = dict(template, **{key: {
                name: np.zeros(saved[key][name].shape, np.dtype(saved[key][name].dtype))
                for name in saved[key]}})
    if layout(saved) != layout(template):
        raise ValueError(
            f"The checkpoint in {path} does not fit this model: it was written "
            "for another model, optimizer or set of metrics, or with another "
            "input (a Grain source's position is saved with it, one row per "
            "process), so its arrays' names or shapes differ "
            f"({difference(layout(saved), layout(template))}). Resume with the "
            "same model, compile arguments and input, or pass a new checkpoint_dir.")
    kind = next((key for key in (SUMS, LEGACY_SUMS) if key in saved), None)
    if kind is not None:
        count = len(leaves(template))
        template = dict(template, **{kind: np.zeros(count, _SUM_DTYPES[kind])})
    try:
        tree = manager.restore(index, args=restore_args(template))
    except Exception as error:  # noqa: BLE001 - the layout fits: damaged
        return f"its data could not be read ({short(error)})", None
    if kind is None:
        _messages.warn(
            f"keras_dp: the checkpoint {path} has no checksums (a keras_dp from "
            "before they were added wrote it), so it is restored unchecked.",
            RuntimeWarning)
        return None, tree
    wrong = mismatched(tree, kind)
    if wrong:
        return (f"{len(wrong)} arrays differ from the checksums written with "
                f"them ({', '.join(wrong[:3])}{', ...' if len(wrong) > 3 else ''})"), None
    return None, tree


def leaves(tree):
    """`(name, array)` for every array of a checkpoint tree but its checksums."""
    flat, _ = jax.tree_util.tree_flatten_with_path(
        {key: value for key, value in tree.items() if key not in _SUM_DTYPES})
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in flat]


def bitsums(tree):
    """The checksum of each array of a checkpoint tree, in `leaves` order (uint32).

    Each is the sum, modulo 2**32, of the array's bits read as 32-bit words,
    each word weighted by an odd hash of its position in the whole array.
    Integer sums are exact in any order, so the value does not depend on how
    the array is split: each device sums its own slice and XLA adds the
    partial sums. Any one word changed changes the sum (an odd weight is
    invertible modulo 2**32). `jax.Array`s are summed where they lie, with
    no gather; numpy arrays on this process's first device. Across
    processes every process must call this for the same tree.
    """
    arrays = [leaf if isinstance(leaf, jax.Array)
              else jax.device_put(np.asarray(leaf), jax.local_devices()[0])
              for _, leaf in leaves(tree)]
    groups = {}  # one compiled call per set of devices
    for position, array in enumerate(arrays):
        groups.setdefault(frozenset(array.sharding.device_set), []).append(position)
    sums = np.zeros(len(arrays), np.uint32)
    for positions in groups.values():
        results = _bitsums_of([arrays[position] for position in positions])
        for position, result in zip(positions, results):
            # A 0-d result is replicated: any local copy is the whole value.
            sums[position] = np.asarray(result.addressable_data(0))
    return sums


@jax.jit
def _bitsums_of(arrays):
    return [_bitsum(array) for array in arrays]


def _bitsum(array):
    """Inside a compiled function: one array's checksum (see `bitsums`), a uint32 scalar."""
    words = _words(array)
    index = jnp.zeros(words.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(words.ndim)):  # the flat position, as iotas: splits freely
        index = index + lax.broadcasted_iota(jnp.uint32, words.shape, axis) * jnp.uint32(stride)
        stride *= words.shape[axis]
    return jnp.sum(words * _odd_hash(index), dtype=jnp.uint32)


def _words(array):
    """An array's bits as uint32 words (a 64-bit element is two; a narrow one, widened)."""
    if array.dtype == jnp.bool_:
        return array.astype(jnp.uint32)
    size = np.dtype(array.dtype).itemsize
    if size >= 4:
        return lax.bitcast_convert_type(array, jnp.uint32)
    narrow = {1: jnp.uint8, 2: jnp.uint16}[size]
    return lax.bitcast_convert_type(array, narrow).astype(jnp.uint32)


def _odd_hash(index):
    """A well-mixed odd uint32 for each uint32 position (murmur3's finaliser, low bit set)."""
    index = index ^ (index >> 16)
    index = index * jnp.uint32(0x85EBCA6B)
    index = index ^ (index >> 13)
    index = index * jnp.uint32(0xC2B2AE35)
    return (index ^ (index >> 16)) | jnp.uint32(1)


def crc32s(tree):
    """The CRC-32 of each array's bytes, in `leaves` order: an older keras_dp's checksums."""
    return np.asarray([zlib.crc32(np.ascontiguousarray(leaf).tobytes())
                       for _, leaf in leaves(tree)], dtype=np.int64)


def mismatched(tree, kind=SUMS):
    """The names of the arrays of a restored tree that differ from its checksums.

    `kind` is the key the checksums are under: `SUMS`, or `LEGACY_SUMS`
    (CRC-32s, computed on the host: the arrays must be addressable here).
    """
    expected = np.asarray(tree[kind])
    actual = bitsums(tree) if kind == SUMS else crc32s(tree)
    if expected.shape != actual.shape:
        return ["the checksum list itself"]
    return [name for (name, _), a, b in zip(leaves(tree), actual, expected) if a != b]


def layout(tree):
    """Each array's name, shape and dtype: what must match for a restore to fit."""
    return [(name, tuple(leaf.shape), np.dtype(leaf.dtype).name) for name, leaf in leaves(tree)]


def difference(saved, wanted):
    """Where layout `saved` (a checkpoint's) and `wanted` (this model's) first differ, in words.

    Example: "['state']['optimizer']: 2 arrays in the checkpoint, 10 for this
    model; the first that differs, ['state']['optimizer'][2], is absent there
    and (4, 8) float32 here".
    """
    saved = {name: tuple(rest) for name, *rest in saved}
    wanted = {name: tuple(rest) for name, *rest in wanted}
    name = min((name for name in saved.keys() | wanted.keys()
                if saved.get(name) != wanted.get(name)), key=_natural)
    group = name.rsplit("[", 1)[0]
    counts = [sum(other.rsplit("[", 1)[0] == group for other in layout_of)
              for layout_of in (saved, wanted)]
    return (f"{group}: {counts[0]} arrays in the checkpoint, {counts[1]} for this model; "
            f"the first that differs, {name}, is {_described(saved.get(name))} there "
            f"and {_described(wanted.get(name))} here")


def _natural(name):
    """`name`'s sort key with its indices as numbers: `[2]` before `[10]`."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part)
            for part in name.replace("]", "[").split("[")]


def _described(entry):
    """An array's `(shape, dtype)` in words, or "absent"."""
    return "absent" if entry is None else f"{entry[0]} {entry[1]}"


def short(error):
    """An error's first line, at most 200 characters: orbax's can be pages long."""
    text = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return f"{type(error).__name__}: {text[:200]}"
