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

Every array saved has its CRC-32 saved with it, checked on restore, so a
damaged file is told apart from a checkpoint of another model (whose
arrays' names, shapes or dtypes differ: `layout`).
"""

import errno
import fcntl
import os
import shutil
import socket
import warnings
import zlib

import numpy as np

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
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, LOCK_FILE)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            holder = os.pread(self._fd, 200, 0).decode(errors="replace").strip()
            self._close()
            if error.errno not in (errno.EAGAIN, errno.EACCES):
                # A filesystem without locks: say so, and go on unguarded.
                warnings.warn(
                    f"keras_dp: cannot lock {directory} ({error.strerror}); "
                    "make sure no other run writes checkpoints there.",
                    RuntimeWarning, stacklevel=2)
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


def check_room(directory, checkpoint_bytes, checkpoints_to_add, free_bytes=None):
    """Raise `OSError` (ENOSPC) if `directory` lacks room for the checkpoints to come.

    `checkpoints_to_add` checkpoints of `checkpoint_bytes` each (plus a
    little metadata) must fit in the free space of the filesystem holding
    `directory`, read with `shutil.disk_usage` unless `free_bytes` is given.
    """
    need = checkpoints_to_add * (checkpoint_bytes + _OVERHEAD_BYTES)
    free = shutil.disk_usage(directory).free if free_bytes is None else free_bytes
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


def read_verified(manager, index, template, restore_args):
    """Checkpoint `index` of an orbax `manager`: `(None, tree)` if intact, else `(what is wrong, None)`.

    `template` is the tree to restore into (see `keras_dp.checkpoint`), and
    `restore_args` orbax's `StandardRestore`. A checkpoint written without
    checksums is restored with a warning that it is unchecked.

    Raises:
        ValueError: the checkpoint is readable but does not fit `template`
            (its arrays' names, shapes or dtypes differ).
    """
    path = os.path.join(str(manager.directory), str(index))
    try:
        saved = manager.item_metadata(index).tree
    except Exception as error:  # noqa: BLE001 - any read error means damaged
        return f"its metadata could not be read ({short(error)})", None
    if layout(saved) != layout(template):
        raise ValueError(
            f"The checkpoint in {path} does not fit this model: it was written "
            "for another model, optimizer or set of metrics, or with another "
            "input (a Grain source's position is saved with it, one row per "
            "process), so its arrays' names or shapes differ. Resume with the "
            "same model, compile arguments and input, or pass a new checkpoint_dir.")
    checked = "checksums" in saved
    if not checked:
        template = {key: value for key, value in template.items() if key != "checksums"}
    try:
        tree = manager.restore(index, args=restore_args(template))
    except Exception as error:  # noqa: BLE001 - the layout fits: damaged
        return f"its data could not be read ({short(error)})", None
    if not checked:
        warnings.warn(
            f"keras_dp: the checkpoint {path} has no checksums (a keras_dp from "
            "before they were added wrote it), so it is restored unchecked.",
            RuntimeWarning, stacklevel=4)
        return None, tree
    wrong = mismatched(tree)
    if wrong:
        return (f"{len(wrong)} arrays differ from the checksums written with "
                f"them ({', '.join(wrong[:3])}{', ...' if len(wrong) > 3 else ''})"), None
    return None, tree


def leaves(tree):
    """`(name, array)` for every array of a checkpoint tree but its checksums."""
    import jax

    flat, _ = jax.tree_util.tree_flatten_with_path(
        {key: value for key, value in tree.items() if key != "checksums"})
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in flat]


def checksums(tree):
    """The CRC-32 of each array's bytes, in `leaves` order."""
    return np.asarray([zlib.crc32(np.ascontiguousarray(leaf).tobytes())
                       for _, leaf in leaves(tree)], dtype=np.int64)


def mismatched(tree):
    """The names of the arrays of a restored tree that differ from its checksums."""
    expected = np.asarray(tree["checksums"])
    actual = checksums(tree)
    if expected.shape != actual.shape:
        return ["the checksum list itself"]
    return [name for (name, _), a, b in zip(leaves(tree), actual, expected) if a != b]


def layout(tree):
    """Each array's name, shape and dtype: what must match for a restore to fit."""
    return [(name, tuple(leaf.shape), np.dtype(leaf.dtype).name) for name, leaf in leaves(tree)]


def short(error):
    """An error's first line, at most 200 characters: orbax's can be pages long."""
    text = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return f"{type(error).__name__}: {text[:200]}"
