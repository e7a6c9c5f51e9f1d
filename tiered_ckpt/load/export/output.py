"""The export's output file or folder: written beside its final name, then moved there in one rename."""
from __future__ import annotations

import errno
import os
import secrets
import shutil
from pathlib import Path

from ...storage.files import check_creatable, fsync_dir


def check_output(out: Path, *, directory: bool, force: bool) -> None:
    """Before anything is read: `out` may be written (its folder exists and is writable, or can be created), and
    replaced only with `force`."""
    folder = out.parent
    if folder.is_dir():
        if not os.access(folder, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "cannot create files in this folder", str(folder))
    else:
        check_creatable(folder)  # a file in the way, no permission (missing folders are created)
    if not out.exists() and not out.is_symlink():
        return
    if not force:
        raise FileExistsError(f"{out} exists; pass --force (force=True) to replace it")
    if out.is_dir() != directory:
        kind = "a directory" if out.is_dir() else "a file"
        raise FileExistsError(f"{out} exists and is {kind}; not replaced by a {'directory' if directory else 'file'}")


def temp_path(out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    return out.parent / f".{out.name}.export-{os.getpid()}-{secrets.token_hex(4)}"


def publish(tmp: Path, out: Path, force: bool) -> None:
    """Move the finished `tmp` to `out` (a rename: readers see the old one or the whole new one)."""
    check_output(out, directory=tmp.is_dir(), force=force)  # it may have appeared meanwhile
    if tmp.is_dir() and out.exists():  # a directory cannot be renamed over a non-empty one
        old = temp_path(out)
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)
    fsync_dir(out.parent)


def discard(tmp: Path) -> None:
    if tmp.is_dir():
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.unlink(missing_ok=True)
