"""Replace a folder by another in one step: what makes a checkpoint save atomic.

    sync_tree(tmp)           fsync every file and folder under tmp: its contents are on disk
    replace_dir(tmp, path)   tmp becomes path, over the folder there if any, in one rename

On Linux the two folders are swapped with renameat2(RENAME_EXCHANGE) (the C library's, through ctypes:
Python has no binding), so `path` names the old folder or the new one, whole, at every instant, even if
the process is killed; the old one, now at `tmp`, is then removed. Where the kernel or the file system
lacks the exchange, the old folder is moved aside to `.NAME.old` for the instant between two renames.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
from pathlib import Path


def sync_tree(root: Path) -> None:
    """fsync every file and folder under `root` (and root): its contents are on disk before the rename."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in [*files, "."]:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


_RENAME_EXCHANGE = 2  # linux/fs.h


def exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where it is not available."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        return False
    at_fdcwd = -100
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    e = ctypes.get_errno()
    if e in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):  # the kernel or the file system lacks it
        return False
    raise OSError(e, os.strerror(e), str(b))


def replace_dir(tmp: Path, path: Path) -> None:
    """Put the folder `tmp` at `path`, over the folder there if any: at every instant `path` holds the old
    folder or the new one, whole (where the exchange is not available the old one is moved aside first,
    to `.NAME.old` beside it, for the instant between two renames)."""
    if not path.exists():
        os.rename(tmp, path)
    elif exchange(tmp, path):
        shutil.rmtree(tmp)  # the old folder, now at tmp
    else:
        old = path.parent / f".{path.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself
    finally:
        os.close(fd)
