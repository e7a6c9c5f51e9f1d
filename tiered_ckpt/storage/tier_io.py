"""TierIO: the configured tiers, fastest first, each behind its own pipeline and thread pool: the only door
into a tier driver.

Every call the library makes on a tier goes through here, with the tier's timeout and retries: writes,
reads, listings, deletions, the checks before a commit, and `read_verified`, the one way a part is read back (by load, by a save whose staging buffer was handed on, and by verify). Each read
has the tier's timeout and retries (and, but for a save's read-back, whose bytes the writing tier's budget
already counts, its byte budget and worker slots), and its checksum is checked over exactly the bytes read
before the next tier is tried.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncContextManager, Callable, Iterable, Iterator, Sequence, TypeVar

from ..checksum import ALGORITHM, chunk_digest, describe, of_chunk_digests, part_checksum
from ..config import TierConfig
from ..errors import IntegrityError, TierError
from ..tier_kinds import driver_class
from .pipeline import SaveTurns, TierPipeline
from .tiers.base import FileTier, Tier, scatter, start_tier

if TYPE_CHECKING:  # torch is imported where buffers are made: listing and deleting need none (the CLI)
    import torch

T = TypeVar("T")


@dataclass(frozen=True)
class Fallback:
    """A part that the preferred tier could not serve intact."""

    part: str
    tier: str
    reason: str


@dataclass
class PartRead:
    """One part to read: its key, the buffers its bytes fill in order, its length and expected checksum, and
    the caller's entries (`targets`) whose own memory some of those buffers are. A `bounce` part (every
    part a load reads) is read into a bounce buffer and verified before a byte reaches `views`."""

    key: str
    views: list[memoryview]
    length: int
    checksum: int
    targets: tuple[str, ...] = ()
    bounce: bool = False
    algorithm: str = ALGORITHM  # of `checksum` (the manifest names it)
    chunk_size: int = 0  # with chunk_sums (8 bytes a chunk): verified and copied a chunk at a time (format 4)
    chunk_sums: bytes = b""
    target_starts: tuple[int, ...] = ()  # where in the part each of `targets` begins
    check_whole: bool = False  # read in chunks: also check the part's own checksum (verify does; a load need not)
    touched: tuple[str, ...] = ()  # targets that verified chunks reached, of a part whose read then failed
    spans: tuple[tuple[int, int], ...] = ()  # (offset, length) in the part of the views the caller wants (a load)

    def wanted_views(self) -> list[memoryview]:
        """The views that `spans` names, in order (the others fill the bytes the caller does not want)."""
        wanted, at, out = set(self.spans), 0, []
        for view in self.views:
            if (at, len(view)) in wanted:
                out.append(view)
            at += len(view)
        return out


@dataclass
class ReadLog:
    """What reads report: per-part fallbacks, bytes served per tier, bytes received by broadcast from the
    reader of a replica group, and the caller's entries already written."""

    fallbacks: list[Fallback] = field(default_factory=list)
    bytes_by_tier: dict[str, int] = field(default_factory=dict)
    bytes_received: int = 0
    overwritten: set[str] = field(default_factory=set)


class BouncePool:
    """A few reusable part-sized buffers (touched once, not per load), so a part is verified before a byte of
    it reaches its destination, without a second copy of the whole state. `slot()` bounds how many part
    reads hold buffers at once. A buffer that an abandoned attempt (a timeout, a cancellation) may still be
    writing from a thread is dropped, never reused."""

    def __init__(self, count: int):
        self._free: list[torch.Tensor] = []
        self._dropped: list[torch.Tensor] = []  # unmapped by clear(), in a thread: never on the event loop
        self.count = count
        self.slot = asyncio.Semaphore(count)

    def take(self, nbytes: int) -> torch.Tensor:
        fits = next((i for i, b in enumerate(self._free) if b.numel() >= nbytes), None)  # by position: `in`
        if fits is not None:  # and remove() would compare tensors elementwise
            return self._free.pop(fits)
        import torch

        return torch.empty(max(nbytes, 1), dtype=torch.uint8)  # (not touched: no page is allocated here)

    def give(self, buf: torch.Tensor) -> None:
        self._free.append(buf)
        if len(self._free) > self.count:  # too many of the wrong size: the smallest goes
            smallest = min(range(len(self._free)), key=lambda i: self._free[i].numel())
            self._dropped.append(self._free.pop(smallest))

    def drop(self, buf: torch.Tensor) -> None:
        """A buffer that must not be reused (a thread may still write it); freed at the next clear()."""
        self._dropped.append(buf)

    def clear(self) -> None:
        """Free every buffer (call it in a thread: unmapping part-sized buffers takes milliseconds)."""
        self._free.clear()
        self._dropped.clear()


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
        self.bounce = BouncePool(max(2, io_threads))

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
            await driver.write(key, memoryview(b"probe"))
            await driver.delete(key)
        await self._pipelines[tier].once(op, f"write a probe value ({key})", timeout)

    async def read(self, tier: str, key: str) -> bytes:
        """A whole small value (a manifest, a record). TierNotFound when absent."""
        return await self._pipelines[tier].attempt(lambda: self._drivers[tier].read(key), f"read {key}")

    async def list(self, tier: str, prefix: str) -> list[str]:
        return await self._pipelines[tier].attempt(lambda: self._drivers[tier].list(prefix), f"list {prefix}")

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

    async def read_verified(self, part: PartRead, tiers: Sequence[str], log: ReadLog, *, budgeted: bool = True) -> str:
        """Fill `part.views` from the first of `tiers` (in that order) that returns the part whole and with
        the expected checksum; return that tier's name. A `bounce` part goes through a bounce buffer: its
        views receive only verified bytes, and its targets are added to `log.overwritten`.
        Each failed try is added to `log.fallbacks`; when none succeeds, raise IntegrityError naming every
        reason. Every try has the tier's timeout and retries; `budgeted` also holds the tier's byte budget
        and a worker slot while it runs."""
        reasons = []
        for name in tiers:
            if part.bounce:
                async with self.bounce.slot:
                    reason = await self._try_bounced_read(name, part, budgeted)
                if reason is None:
                    log.overwritten.update(part.targets)
                else:
                    log.overwritten.update(part.touched)
            else:
                reason = await self._try_read(name, part.key, part.views, part, budgeted)
            if reason is None:
                log.bytes_by_tier[name] = log.bytes_by_tier.get(name, 0) + part.length
                return name
            log.fallbacks.append(Fallback(part.key, name, reason))
            reasons.append(f"{name}: {reason}")
        raise IntegrityError(f"part {part.key}: no tier returned it intact "
                             f"({'; '.join(reasons) or 'no tier holds this checkpoint'})")

    async def _try_chunked_read(self, name: str, part: PartRead, budgeted: bool) -> tuple[bool, str | None]:
        """On a tier of files: read the part a chunk at a time into a buffer that stays in cache, check the
        chunk's digest, then copy it to `part.views`: one pass over memory, and no byte of a chunk reaches its
        destination before the chunk passed. A chunk that fails stops the read (the chunks before it are
        written, verified; the part is then read whole from the next tier). The chunk digests are the sealed
        record's, so they are enough for a load; `check_whole` also checks that the part's own checksum is the
        digest of those chunk digests (verify does). (False, None) when the tier cannot read it that way now."""
        driver = self.file_tier(name)
        assert driver is not None
        size, sums = part.chunk_size, memoryview(part.chunk_sums).cast("B")
        outcome: list[str] = []

        written = [0]  # bytes of the part that verified chunks put in place

        def consume(chunk: memoryview, at: int) -> bool:
            index = at // size
            expected = int.from_bytes(sums[8 * index:8 * index + 8], "little")
            actual = chunk_digest(chunk, part.algorithm)
            if actual != expected:
                outcome.append(f"chunk {index}: {describe(part.algorithm, actual)}, expected "
                               f"{describe(part.algorithm, expected)}")
                return False
            scatter([chunk], part.views, at)
            written[0] = at + len(chunk)
            return True

        pipeline, what = self._pipelines[name], f"read {part.key}"
        op = lambda: driver.read_chunks(part.key, size, part.length, consume)  # noqa: E731
        try:
            n = await (pipeline.submit(part.length, op, what) if budgeted else pipeline.attempt(op, what))
        except TierError as e:
            return True, f"{type(e).__name__}: {e}"
        if n is None:
            return False, None
        if written[0]:  # verified chunks reached the destination, whatever comes next
            starts = part.target_starts or (0,) * len(part.targets)
            part.touched = tuple(t for t, at in zip(part.targets, starts) if at < written[0])
        if n != part.length:
            return True, f"length {n}, expected {part.length}"
        if outcome:
            return True, outcome[0]
        if len(sums) != 8 * (-(-part.length // size)):
            return True, f"{len(sums) // 8} chunk digests for {-(-part.length // size)} chunks"
        whole = of_chunk_digests(part.chunk_sums, part.algorithm) if part.check_whole else part.checksum
        if whole != part.checksum:  # the chunks are the record's: the part's checksum follows from their digests
            return True, (f"{describe(part.algorithm, whole)}, expected {describe(part.algorithm, part.checksum)} "
                          f"(the record's chunk digests disagree)")
        return True, None

    async def _try_bounced_read(self, name: str, part: PartRead, budgeted: bool) -> str | None:
        """Read `part` into a bounce buffer (a fresh one for every attempt, retries included), verify it, then
        copy it to `part.views`; None when that succeeded, else why not. A tier of files reads a part with chunk
        digests a chunk at a time instead (no bounce buffer, one pass)."""
        from ..buffers import tensor_bytes

        files = self.file_tier(name)
        if files is not None and part.chunk_size and part.chunk_sums:
            done, reason = await self._try_chunked_read(name, part, budgeted)
            if done:
                return reason
        current: list[torch.Tensor] = []

        async def attempt() -> int:
            buf = self.bounce.take(part.length)
            current[:] = [buf]
            try:
                return await self._drivers[name].read_into(part.key, [tensor_bytes(buf)[:part.length]])
            except BaseException:
                self.bounce.drop(buf)  # a thread may still be writing it (timeout, cancellation): never reuse it
                current.clear()
                raise

        pipeline, what = self._pipelines[name], f"read {part.key}"
        try:
            n = await (pipeline.submit(part.length, attempt, what) if budgeted else pipeline.attempt(attempt, what))
        except TierError as e:
            return f"{type(e).__name__}: {e}"
        buf = current[0]
        view = tensor_bytes(buf)[:part.length]
        reason = await self._verify([view], n, part)
        if reason is None:
            await self.run_blocking(scatter, [view], part.views)
        self.bounce.give(buf)
        return reason

    async def _try_read(self, name: str, key: str, views: list[memoryview], part: PartRead,
                        budgeted: bool) -> str | None:
        """None when `part` was read intact from tier `name` into `views`, else why not."""
        pipeline, what = self._pipelines[name], f"read {key}"
        op = lambda: self._drivers[name].read_into(key, views)  # noqa: E731
        try:
            n = await (pipeline.submit(part.length, op, what) if budgeted else pipeline.attempt(op, what))
        except TierError as e:
            return f"{type(e).__name__}: {e}"
        return await self._verify(views, n, part)

    async def _verify(self, views: list[memoryview], n: int, part: PartRead) -> str | None:
        if n != part.length:
            return f"length {n}, expected {part.length}"
        chunk_size = part.chunk_size if part.chunk_sums else 0  # format 4: the digest of the chunks' digests
        actual = await self.run_blocking(part_checksum, views, part.algorithm, chunk_size)
        if actual != part.checksum:
            return f"{describe(part.algorithm, actual)}, expected {describe(part.algorithm, part.checksum)}"
        return None
