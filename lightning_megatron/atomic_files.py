"""A finished folder put in place atomically: what a checkpoint save and an export (Hugging Face, PEFT) end with.

The folder is written whole under a temporary name beside its final one, its files and the folder synced to
disk (:func:`fsync_tree`), then exchanged with what is at the final name in one step (Linux ``renameat2``'s
``RENAME_EXCHANGE``: there is no moment in which the name is missing or half there), the parent synced (the
rename durable), and the previous folder removed from under the temporary name. Where the system cannot
exchange, two renames, the old folder kept at ``<final>.tmp-old`` until the second one is done.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import sys
import uuid
from pathlib import Path

__all__ = ["finalize_directory", "fsync_dir", "fsync_tree", "publish_once", "remove_path", "unique_tag"]

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def fsync_dir(path: Path) -> None:
    """Sync a folder's entries (its renames) to disk; a no-op where the file system cannot."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # not every file system syncs directories
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Sync every file under ``root`` and every folder, ``root`` last (what a writer such as ``save_pretrained``
    left in the page cache: after a power loss, a folder whose names are all there could hold empty files)."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        fsync_dir(Path(folder))


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2). False where the system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False  # kernel or file system without RENAME_EXCHANGE
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def remove_path(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    elif p.exists() or p.is_symlink():
        p.unlink(missing_ok=True)


def finalize_directory(tmp: Path, final: Path) -> None:
    """Put the complete ``tmp`` at ``final``; an existing ``final`` is replaced without a moment in
    which the name is missing (rename exchange; elsewhere two renames, the old copy kept as
    ``<final>.tmp-old`` until the second one is done). The parent is synced once the new folder is in place."""
    if final.exists() or final.is_symlink():
        if _exchange(tmp, final):
            fsync_dir(final.parent)
            remove_path(tmp)  # the previous folder, now under the temporary name
            return
        old = final.with_name(final.name + ".tmp-old")
        remove_path(old)
        os.replace(final, old)
        os.replace(tmp, final)
        fsync_dir(final.parent)
        remove_path(old)
    else:
        os.replace(tmp, final)
        fsync_dir(final.parent)


_NO_LINKS = (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK, errno.EXDEV)
"""``link`` errors of a file system without hard links (some FUSE and object-store mounts): publish by rename."""


def publish_once(tmp: Path, final: Path) -> None:
    """Put the complete file ``tmp`` at ``final`` unless a file is already there, and remove ``tmp``.

    For a cached file named by its content's key: a second builder (another node whose lock did not see the
    first's) holds the same bytes, and its copy is dropped. The file in place is never replaced, so a process that
    has it open or memory-mapped keeps reading it (a network file system's client reads a replaced file's pages
    as ``ESTALE``). ``os.link`` fails when the name is taken; a file system without hard links renames instead.
    """
    try:
        os.link(tmp, final)
    except FileExistsError:
        pass  # published by another builder: keep theirs
    except OSError as e:
        if e.errno not in _NO_LINKS:
            raise
        os.replace(tmp, final)
        return
    os.unlink(tmp)


def unique_tag() -> str:
    """A temporary file's tag no other writer shares: the process id and a random part (the id alone repeats
    across the nodes of a job whose containers start alike; two nodes building one cache on shared storage
    opened the same temporary file, the second truncating what the first had written)."""
    return f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
