"""The tier driver contract: six async methods over string keys.

Drivers hold no retries and no concurrency limits (the pipeline owns both). Blocking work runs in
`self.executor` threads so the event loop never blocks. Lifecycle: the engine constructs a driver with
its options, sets `executor`, calls `open()`, then any mix of the methods from one event loop, then `close()`.
"""
from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Sequence, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class PartKey:
    """Where one part of one rank of one checkpoint lives on every tier."""

    job: str
    step: int
    rank: int
    index: int

    @property
    def path(self) -> str:
        return f"{step_prefix(self.job, self.step)}rank-{self.rank:05d}/part-{self.index:06d}"


def step_prefix(job: str, step: int) -> str:
    return f"{job}/step-{step:012d}/"


def manifest_key(job: str, step: int) -> str:
    return f"{step_prefix(job, step)}manifest.msgpack"


def rank_meta_key(job: str, step: int, rank: int) -> str:
    return f"{step_prefix(job, step)}rank-{rank:05d}/checksums.msgpack"


@dataclass(frozen=True)
class TierCaps:
    """What the engine may assume of a tier."""

    persistent: bool = True  # survives the training process
    max_object_size: int | None = None  # a part must not exceed this


@dataclass(frozen=True)
class NoOptions:
    pass


class Tier(ABC):
    Options: ClassVar[type] = NoOptions
    caps: ClassVar[TierCaps] = TierCaps()

    def __init__(self, name: str, options: Any):
        self.name = name
        self.options = options
        self.executor: Executor | None = None

    def bind(self, *, rank: int, world_size: int, node: int, num_nodes: int) -> None:
        """Where this process sits (rank, node), for tiers whose placement depends on it. Called before open()."""

    async def open(self) -> None:
        """Connect or create directories. Called once before any other method."""

    async def close(self) -> None:
        """Release connections. Pending operations have finished when the engine calls this."""

    @abstractmethod
    async def write(self, key: str, data: memoryview) -> None:
        """Store `data` under `key`, replacing any old value atomically; durable when it returns."""

    @abstractmethod
    async def read_into(self, key: str, out: Sequence[memoryview]) -> int:
        """Fill the buffers in `out` in order from the stored value; return the stored value's length.

        Raises TierNotFound when the key is absent. A length other than sum(len(b) for b in out) means the
        stored value is truncated or oversized; the buffers' contents are then undefined.
        """

    @abstractmethod
    async def read(self, key: str) -> bytes:
        """Return a whole (small) value, e.g. a manifest. Raises TierNotFound."""

    @abstractmethod
    async def delete(self, prefix: str) -> None:
        """Remove every key starting with `prefix`; absent keys are not an error."""

    @abstractmethod
    async def list(self, prefix: str) -> list[str]:
        """Keys starting with `prefix`, sorted."""

    async def missing(self, keys: Sequence[str]) -> list[str]:
        """Which of `keys` are no longer stored, checked just before a commit. Tiers whose writes are
        durable when they return (files fsynced) can't lose them and return []; a cache that may restart
        or evict (Redis) checks, so a checkpoint never becomes complete on it with parts already gone."""
        return []

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)


def scatter(data: bytes | memoryview, out: Sequence[memoryview]) -> int:
    """Copy `data` into the buffers of `out` in order (for drivers that receive whole values)."""
    view = memoryview(data)
    pos = 0
    for buf in out:
        n = min(len(buf), len(view) - pos)
        buf[:n] = view[pos : pos + n]
        pos += n
    return len(view)
