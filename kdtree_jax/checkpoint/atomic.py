"""Write a checkpoint directory so that it appears whole or not at all.

Everything is written into a hidden sibling `.NAME.partial-XXXX` and renamed into place at the end; an error
removes it, and a process killed mid-write leaves only that hidden directory, which the next write to the same
destination cleans up. Readers never see a half-written checkpoint under the real name.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

DIR_MODE, FILE_MODE = 0o755, 0o644  # mkdtemp makes 0700; checkpoints are meant to be shared


def partial_prefix(path: str) -> str:
    return f".{os.path.basename(path)}.partial-"


def remove_stale_partials(path: str) -> None:
    """Leftovers of a killed write into `path`."""
    parent, prefix = os.path.dirname(path), partial_prefix(path)
    for name in os.listdir(parent):
        if name.startswith(prefix):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, *, overwrite: bool = True) -> Iterator[str]:
    """Yield a temp dir next to `path`; on success it replaces `path` by rename, on error it is removed."""
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(f"{path}: already exists (pass overwrite/--force to replace it)")
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    remove_stale_partials(path)
    tmp = tempfile.mkdtemp(prefix=partial_prefix(path), dir=parent)
    old = None
    try:
        os.chmod(tmp, DIR_MODE)
        yield tmp
        for dirpath, dirnames, filenames in os.walk(tmp):
            for d in dirnames:
                os.chmod(os.path.join(dirpath, d), DIR_MODE)
            for f in filenames:
                os.chmod(os.path.join(dirpath, f), FILE_MODE)
        if os.path.exists(path):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.old-", dir=parent)
            os.rename(path, os.path.join(old, "d"))
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old and not os.path.exists(path) and os.path.exists(os.path.join(old, "d")):
            os.rename(os.path.join(old, "d"), path)  # the commit failed after moving the old one aside: put it back
        if old:
            shutil.rmtree(old, ignore_errors=True)
        raise
    if old:
        shutil.rmtree(old)


def write_text_atomic(path: str | os.PathLike, text: str) -> str:
    """One file, whole or not at all: a temp file in the same directory, fsynced, then renamed over `path`."""
    path = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=partial_prefix(path), dir=parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path
