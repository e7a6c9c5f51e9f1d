"""Host memory as files under /dev/shm: a restarted trainer on the same node can still load from it.

The same file driver as `local`, without fsync (tmpfs has no disk behind it) and with a capacity by
default, because tmpfs pages come out of the node's RAM. A load reads a part a chunk at a time under a shared
flock (`read_chunks`), so a retired part file is never rewritten as a staging buffer under a reader.
"""
from __future__ import annotations

import fcntl
import os
import pwd
import re
from dataclasses import dataclass, field
from pathlib import Path

from .local import LocalTier


def default_path() -> str:
    """/dev/shm/tiered_ckpt-<user>: a folder of this user's own, so a second user of the machine is not locked
    out of a folder the first one made, nor counts the first one's checkpoints. The user is the name the
    password database gives this process's uid (no $USER needed), or `uid<N>` where there is none."""
    uid = os.getuid()
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:  # a container's arbitrary uid
        name = ""
    return f"/dev/shm/tiered_ckpt-{name if re.fullmatch(r'[A-Za-z0-9._-]+', name) else f'uid{uid}'}"


@dataclass(frozen=True)
class MemoryOptions:
    path: str = field(default_factory=default_path)
    capacity: int | None = field(default=16 * 2**30, metadata={"size": True, "min": 1})
    fsync: bool = False


class MemoryTier(LocalTier):
    Options = MemoryOptions
    read_span = 0  # a chunk at a time: RAM needs no large requests, and a chunk stays in cache
    private = True  # host memory of this user's jobs, in a shared /dev/shm: no one else's business

    def _open_for_chunks(self, path: Path) -> int | None:
        """Held with a shared flock for the whole read, taken while the file is still the one under its key (see
        the arena takes files back under an exclusive one): a retired file is never rewritten as a staging buffer
        under this reader. None while it is being retired."""
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except (BlockingIOError, FileNotFoundError):
            pass
        os.close(fd)
        return None
