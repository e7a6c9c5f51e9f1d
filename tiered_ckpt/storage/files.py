"""File-system steps that the file-backed parts (the local and memory tiers, the file index, export) share."""
from __future__ import annotations

import fcntl
import os
import pwd
import stat
from pathlib import Path


def locked_elsewhere(fd: int) -> bool:
    """Whether another process holds an exclusive flock on `fd`'s file (a live owner: the kernel drops the
    lock when a process dies, however it dies). Tested with a shared lock that is not waited for; taken, it
    goes when `fd` is closed."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True


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


def cannot_write(folder: Path) -> str | None:
    """Why this process could not create files in `folder` (made first where missing), told without writing
    anything: the nearest folder that exists is no folder, is on a read-only file system, or this user may not
    write in it. None when nothing says so; some refusals show only when written (/proc takes no folder even
    from root, whose permissions it passes)."""
    path = folder.absolute()
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    if not path.is_dir():
        return f"{path} is not a directory"
    if os.statvfs(path).f_flag & os.ST_RDONLY:
        return f"{path} is on a read-only file system"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"this user may not write in {path}"
    return None


def make_folders(path: Path, mode: int = 0o700) -> None:
    """`mkdir -p` where every folder it makes gets `mode` (less the umask's bits): Path.mkdir gives the parents
    it makes the umask's mode, which leaves an index's records readable by every local user."""
    missing = []
    while not path.is_dir():
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, mode)
        except FileExistsError:
            pass  # another process made it first


def not_private(path: Path) -> str | None:
    """Why the existing `path` cannot be trusted as this user's private folder (None when it can): a symbolic
    link, not a folder, another user's, or writable by others. A folder under a shared, world-writable parent
    (/dev/shm) may have been made beforehand by another local user to read or swap what goes in it."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link (to {os.readlink(path)})"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a folder"
    mode = f"mode {stat.S_IMODE(st.st_mode):04o}"
    if st.st_uid != os.geteuid():
        return f"{path} belongs to {_user(st.st_uid)}, not to this user ({_user(os.geteuid())}; {mode})"
    if st.st_mode & 0o022:
        return f"{path} can be written by other users ({mode}, owner {_user(st.st_uid)})"
    return None


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"
