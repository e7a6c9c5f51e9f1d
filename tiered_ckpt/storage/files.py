"""File-system steps that the file-backed parts (the local and memory tiers, the file index, export) share."""
from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path, *, missing_ok: bool = False) -> None:
    """Make a rename or unlink in `path` durable (the directory entry, not only the file)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        if missing_ok:
            return
        raise
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_creatable(root: Path) -> None:
    """Raise the OSError that creating `root` would raise (a file in the way, no permission); create nothing.
    A process that only reads (a listing, `tiered-ckpt ls`) checks its folders this way instead of making them."""
    path = root.absolute()
    while not path.exists():
        path = path.parent
    if not path.is_dir():
        raise NotADirectoryError(f"{path} is not a directory")
    if path != root.absolute() and not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot create folders in {path}")
