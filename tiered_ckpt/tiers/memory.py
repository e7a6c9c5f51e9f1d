"""Host memory as files under /dev/shm: a restarted trainer on the same node can still load from it.

The same file driver as `local`, without fsync (tmpfs has no disk behind it) and with a capacity by
default, because tmpfs pages come out of the node's RAM.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .local import LocalTier

SIZE = {"size": True}


@dataclass(frozen=True)
class MemoryOptions:
    path: str = "/dev/shm/tiered_ckpt"
    capacity: int | None = field(default=16 * 2**30, metadata=SIZE)
    fsync: bool = False


class MemoryTier(LocalTier):
    Options = MemoryOptions
