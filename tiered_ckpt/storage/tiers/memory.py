"""Host memory as files under /dev/shm: a restarted trainer on the same node can still load from it.

The same file driver as `local`, without fsync (tmpfs has no disk behind it) and with a capacity by
default, because tmpfs pages come out of the node's RAM. Reads can also map a value in place
(`read_mapped`): a load then verifies the part where it lies and copies it once, into its destination.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import pwd
import re
from dataclasses import dataclass, field
from typing import Callable, TypeVar

from ...errors import TierError, TierNotFound
from .local import LocalTier

T = TypeVar("T")
# page tables filled in one call, not one fault per page while the part is hashed and copied
MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)



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
    maps_reads = True
    folder_mode = 0o700  # host memory of this user's jobs: no one else's business

    async def read_mapped(self, key: str, use: Callable[[memoryview], T]) -> tuple[bool, T | None]:
        """(True, use(view)) with `view` a read-only mapping of `key`'s value; (False, None) when it cannot be
        pinned (the caller then reads a copy). The file of a value can be reused by a staging buffer once
        its checkpoint is retired (the engine renames it away under an exclusive flock, then writes it):
        a shared flock, taken while the file is still the one under `key`, keeps that from happening while
        `use` runs, so what `use` verifies is what it copies."""
        path = self._path(key)

        def pinned() -> tuple[bool, T | None]:
            fd = os.open(path, os.O_RDONLY)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:
                    return False, None  # being retired right now
                st = os.fstat(fd)
                try:
                    if os.stat(path).st_ino != st.st_ino:
                        return False, None  # retired between the open and the lock
                except FileNotFoundError:
                    return False, None
                if st.st_size == 0:
                    return True, use(memoryview(b""))
                with mmap.mmap(fd, st.st_size, flags=MAP_FLAGS, prot=mmap.PROT_READ) as mapped:
                    view = memoryview(mapped)
                    try:
                        return True, use(view)
                    finally:
                        view.release()
            finally:
                os.close(fd)  # releases the lock

        try:
            return await self.run_blocking(pinned)
        except FileNotFoundError:
            raise TierNotFound(f"{path} not found", tier=self.name) from None
        except OSError as e:
            raise TierError(f"mapping {path}: {e}", tier=self.name) from e
