"""TierIO: the configured tiers, fastest first, each behind its own pipeline and thread pool: the only door
into a tier driver.

Every call the library makes on a tier goes through here, with the tier's timeout and retries: writes,
reads, listings, deletions, the checks before a commit, and `read_verified`, the one way a part is read back
(by load, by a save whose staging buffer was handed on, by verify and heal). Each read has the tier's timeout
and retries (and, but for a save's read-back, whose bytes the writing tier's budget already counts, its byte
budget and worker slots); the checking itself is `verified_read.py`'s.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncContextManager, Callable, ContextManager, Iterable, Iterator, Sequence, TypeVar

from ..config import TierConfig
from ..tier_kinds import driver_class
from .pipeline import SaveTurns, TierPipeline
from .tiers.base import FileTier, Tier, start_tier
from .verified_read import BouncePool, PartRead, ReadLog, read_verified

T = TypeVar("T")


def _lower_priority(nice: int) -> None:
    """A worker thread's start: raise its nice value (Linux: a thread's own), never above 19."""
    if nice > 0 and hasattr(os, "setpriority"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(19, os.getpriority(
                os.PRIO_PROCESS, threading.get_native_id()) + nice))
        except OSError:
            pass  # not allowed here: the thread runs at the process's priority


class TierIO:
    """The configured tiers, fastest first: the only way into a driver. Every operation has the tier's timeout
    and retries (its pipeline's); writes and reads also hold the tier's byte budget and a worker slot."""

    def __init__(self, configs: Sequence[TierConfig], io_threads: int, *, background_nice: int = 0):
        self.configs = {t.name: t for t in configs}
        self._drivers: dict[str, Tier] = {t.name: driver_class(t.kind)(t.name, t.options) for t in configs}
        self._pipelines = {t.name: TierPipeline(t.name, workers=t.workers, inflight=t.inflight, retries=t.retries,
                                                timeout=t.timeout, backoff=t.backoff,
                                                skip_when_behind=t.skip_when_behind)
                           for t in configs}
        # The staging copy on threads of its own, at normal priority (a lazy save's copy must be done before the
        # optimizer step); the rest of the CPU work (checksums, scatters) on one pool; each tier's I/O on its own,
        # sized to its pipeline: a disk blocked in fsync must not starve the memory tier, whose speed is what
        # lets the next save reuse the staging buffer early. Everything but the copy runs `background_nice`
        # lower, so a core that training wants goes to training.
        lower = functools.partial(_lower_priority, background_nice)
        self._copies = ThreadPoolExecutor(io_threads, thread_name_prefix="tiered_ckpt-copy")
        self._executor = ThreadPoolExecutor(io_threads, thread_name_prefix="tiered_ckpt", initializer=lower)
        self._hashing = ThreadPoolExecutor(1, thread_name_prefix="tiered_ckpt-hash", initializer=lower)
        self._tier_executors = {t.name: ThreadPoolExecutor(t.workers, thread_name_prefix=f"tiered_ckpt-{t.name}",
                                                           initializer=lower) for t in configs}
        self.bounce = BouncePool(BouncePool.buffers_for(io_threads))

    @property
    def names(self) -> list[str]:
        """Every tier's name, fastest first."""
        return list(self._drivers)

    def __contains__(self, name: object) -> bool:
        return name in self._drivers

    def __iter__(self) -> Iterator[str]:
        return iter(self._drivers)

    def order(self, names: Iterable[str]) -> list[str]:
        """`names` sorted fastest first (the order of [[tiers]] in the config); unknown names dropped."""
        wanted = set(names)
        return [n for n in self._drivers if n in wanted]

    def turns(self, tier: str) -> SaveTurns:
        """Whose turn it is to write a save to `tier` (one writes, one waits)."""
        return self._pipelines[tier].turns

    def retried(self, tier: str) -> int:
        """Operations on `tier` that needed more than one attempt so far."""
        return self._pipelines[tier].retried

    def file_tier(self, name: str) -> FileTier | None:
        """The driver of `name` when its values are files on this machine (the arena stages into them)."""
        driver = self._drivers[name]
        return driver if isinstance(driver, FileTier) else None

    def listed_partly(self, name: str) -> bool:
        """Whether the last listing of `name` left out part of its store it could not reach (Tier.listed_partly)."""
        return bool(getattr(self._drivers[name], "listed_partly", False))

    def driver(self, name: str) -> Tier:
        """The driver itself, for tests and tools that inject faults or look at the store. The library never
        uses it: every one of its calls goes through the methods below, with timeouts and retries."""
        return self._drivers[name]

    async def open(self, *, rank: int, world_size: int, node: int, num_nodes: int) -> None:
        for name, tier in self._drivers.items():
            await start_tier(tier, self._tier_executors[name], rank=rank, world_size=world_size, node=node,
                             num_nodes=num_nodes)

    async def close(self) -> None:
        for tier in self._drivers.values():
            await tier.close()
        self.shutdown()

    def shutdown(self) -> None:
        for executor in (self._copies, self._executor, self._hashing, *self._tier_executors.values()):
            executor.shutdown(wait=False)

    def submit_blocking(self, fn: Callable[..., T], *args: Any) -> "concurrent.futures.Future[T]":
        """run_blocking from any thread (e.g. a staging copy handing finished parts to their checksums)."""
        return self._executor.submit(fn, *args)

    async def run_copy(self, fn: Callable[..., T], *args: Any) -> T:
        """The staging copy, in a thread at the caller's priority (copy_ drops the GIL)."""
        return await asyncio.get_running_loop().run_in_executor(self._copies, fn, *args)

    def submit_hashing(self, fn: Callable[..., T], *args: Any) -> "concurrent.futures.Future[T]":
        """On the one hashing thread: pieces handed over one after the other are hashed in that order."""
        return self._hashing.submit(fn, *args)

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """CPU work (memcpy, checksums) in a thread; the functions used here release the GIL."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # -- one operation on one tier, each with the tier's timeout and retries -------------------------------
    async def write(self, tier: str, key: str, data: memoryview, what: str | None = None) -> None:
        """Store `data` under `key` (budgeted)."""
        await self._pipelines[tier].submit(len(data), lambda: self._drivers[tier].write(key, data),
                                           what or f"write {key}")

    async def write_from(self, tier: str, key: str, nbytes: int,
                         source: Callable[[], AsyncContextManager[memoryview]], what: str) -> None:
        """Store under `key` the `nbytes` that `source()` lends (budgeted); each attempt borrows them anew, so a
        retry after the staging buffer went back reads them from wherever they are then."""
        async def op() -> None:
            async with source() as data:
                await self._drivers[tier].write(key, data)
        await self._pipelines[tier].submit(nbytes, op, what)

    async def probe(self, tier: str, key: str, timeout: float) -> None:
        """Write a small value under `key` and remove it, once, within `timeout`: whether this process can write
        the tier at all (a writer's start), not a write to get done (no retries)."""
        driver = self._drivers[tier]

        async def op() -> None:
            await driver.probe(key)
        await self._pipelines[tier].once(op, f"write a probe value ({key})", timeout)

    async def read(self, tier: str, key: str) -> bytes:
        """A whole small value (a manifest, a record). TierNotFound when absent."""
        return await self._pipelines[tier].attempt(lambda: self._drivers[tier].read(key), f"read {key}")

    async def list(self, tier: str, prefix: str) -> list[str]:
        return await self._pipelines[tier].attempt(lambda: self._drivers[tier].list(prefix), f"list {prefix}")

    async def list_from(self, tier: str, prefix: str, start: str) -> list[str]:
        """Keys under `prefix` sorting at or after `start` (Tier.list_from)."""
        return await self._pipelines[tier].attempt(lambda: self._drivers[tier].list_from(prefix, start),
                                                   f"list {prefix} from {start}")

    async def list_names(self, tier: str, prefix: str, start: str | None = None) -> list[str]:
        """The names directly under folder `prefix`, sorted; with `start`, those from `start` on (Tier.list_names)."""
        return await self._pipelines[tier].attempt(lambda: self._drivers[tier].list_names(prefix, start),
                                                   f"list the names in {prefix}")

    async def delete(self, tier: str, prefix: str) -> None:
        await self._pipelines[tier].attempt(lambda: self._drivers[tier].delete(prefix), f"delete {prefix}")

    async def missing(self, tier: str, keys: Sequence[str]) -> list[str]:
        return await self._pipelines[tier].attempt(lambda: self._drivers[tier].missing(keys),
                                                   f"check {len(keys)} key(s)")

    async def usage(self, tier: str, prefix: str) -> dict[str, int] | None:
        return await self._pipelines[tier].attempt(lambda: self._drivers[tier].usage(prefix), f"measure {prefix}")

    async def debris(self, tier: str, prefix: str, older_than: float) -> list[tuple[str, int]]:
        return await self._pipelines[tier].attempt(lambda: self._drivers[tier].debris(prefix, older_than),
                                                   f"look for debris under {prefix}")

    async def remove_debris(self, tier: str, names: Sequence[str], older_than: float) -> int:
        return await self._pipelines[tier].attempt(lambda: self._drivers[tier].remove_debris(names, older_than),
                                                   f"remove {len(names)} debris item(s)")

    async def read_into(self, tier: str, key: str, nbytes: int,
                        lend: Callable[[], ContextManager[list[memoryview]]], *, budgeted: bool = True) -> int:
        """Read the value under `key` into the buffers `lend()` lends (each attempt borrows them anew, so a
        retry never reuses a buffer an abandoned attempt may still write); its stored length."""
        async def op() -> int:
            with lend() as views:
                return await self._drivers[tier].read_into(key, views)
        pipeline, what = self._pipelines[tier], f"read {key}"
        return await (pipeline.submit(nbytes, op, what) if budgeted else pipeline.attempt(op, what))

    async def read_chunks(self, tier: str, key: str, chunk_size: int, length: int,
                          consume: Callable[[memoryview, int], bool], *, budgeted: bool = True) -> int | None:
        """The driver's `read_chunks` (a tier of files); None when `tier` cannot read that way."""
        driver = self.file_tier(tier)
        if driver is None:
            return None
        pipeline, what = self._pipelines[tier], f"read {key}"
        op = lambda: driver.read_chunks(key, chunk_size, length, consume)  # noqa: E731
        return await (pipeline.submit(length, op, what) if budgeted else pipeline.attempt(op, what))

    async def read_verified(self, part: PartRead, tiers: Sequence[str], log: ReadLog, *,
                            budgeted: bool = True) -> str:
        """`verified_read.read_verified` on these tiers, with this door's bounce buffers: the name of the first
        of `tiers` that returned `part` intact; IntegrityError naming every reason when none did."""
        return await read_verified(self, self.bounce, part, tiers, log, budgeted=budgeted)
