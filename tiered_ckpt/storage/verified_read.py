"""The verified read: how a part comes back from the tiers, fastest first, with its checksum checked over
exactly the bytes read before a byte reaches the caller's memory (a `bounce` part) or before the next tier is
tried. Load, a save's read-back, verify, heal and export all read parts this way, through
`TierIO.read_verified`.

The algorithm lives here and the tier operations in `tier_io.py`: this module sees a tier only through the
two reads of `TierReads` (each with the tier's timeout, retries and byte budget), so it needs no driver.
"""
from __future__ import annotations

import asyncio
import bisect
import contextlib
from dataclasses import dataclass, field
from typing import (TYPE_CHECKING, AbstractSet, Any, Callable, ContextManager, Iterable, Iterator, Protocol, Sequence,
                    TypeVar)

from ..checksum import ALGORITHM, chunk_digest, describe, of_chunk_digests, part_checksum
from ..errors import IntegrityError, TierError
from ..release import empty
from .tiers.base import scatter

if TYPE_CHECKING:  # torch is imported where buffers are made: listing and deleting need none (the CLI)
    import torch

    from ..buffers import Sinks

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
    views: list[memoryview] | Sinks  # Sinks: a load's (buffers.Sinks: no byte view kept per tensor)
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
    # (offset, length) in the part of the views the caller wants (a load: a list, emptied by release a batch at a
    # time, since a part of small tensors wants 100k+ of them and a tuple of them is freed in one step)
    spans: Sequence[tuple[int, int]] = ()

    def release(self) -> None:
        """Drop the buffers, a batch at a time (in a thread: a part of small tensors lists 100k+ of them)."""
        if isinstance(self.views, list):
            empty(self.views)
        else:
            self.views.release()
        empty(self.spans)
        self.targets = self.target_starts = self.touched = ()

    def wanted_views(self) -> list[memoryview] | Sinks:
        """The views that `spans` names, in order (the others take, or skip, the bytes the caller does not want)."""
        if not isinstance(self.views, list):  # Sinks
            return self.views.select(self.spans)
        wanted, at, out = set(self.spans), 0, []
        for view in self.views:
            if (at, len(view)) in wanted:
                out.append(view)
            at += len(view)
        return out


class Overwritten(AbstractSet[str]):
    """The caller's entries that verified bytes reached, a set made only when asked: `update` keeps each part's
    keys as they come (one append on the event loop, where a set would take one insertion per tensor: 1M
    at 1M tensors), and only a failed load's message reads them as a set. A load that succeeded empties it
    (`release`): every entry was overwritten then."""

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._groups: list[Iterable[str]] = []
        self._set: set[str] | None = None
        self.update(tuple(keys))

    def update(self, keys: Iterable[str]) -> None:
        if keys:
            self._groups.append(keys)
            self._set = None

    def _all(self) -> set[str]:
        if self._set is None:
            self._set = set()
            for keys in self._groups:
                self._set.update(keys)
        return self._set

    def release(self) -> None:
        """Forget the keys once the load succeeded (every entry was overwritten then): they are the load's own
        path strings, one per tensor, and the returned LoadInfo would free them wherever its caller drops it (the
        loop). Called in a worker thread, before the other structures that hold the strings (release.py)."""
        empty(self._groups)
        self._set = None

    def __bool__(self) -> bool:
        return bool(self._groups)

    def __contains__(self, key: object) -> bool:
        return key in self._all()

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())

    def __repr__(self) -> str:
        return f"Overwritten({sorted(self._all())!r})"


@dataclass
class ReadLog:
    """What reads report: per-part fallbacks, bytes served per tier, bytes received by broadcast from the
    reader of a replica group, and the caller's entries already written."""

    fallbacks: list[Fallback] = field(default_factory=list)
    bytes_by_tier: dict[str, int] = field(default_factory=dict)
    bytes_received: int = 0
    overwritten: Overwritten = field(default_factory=Overwritten)


class BouncePool:
    """A few reusable part-sized buffers (touched once, not per load), so a part is verified before a byte of
    it reaches its destination, without a second copy of the whole state. `slot()` bounds how many part
    reads hold buffers at once. A buffer that an abandoned attempt (a timeout, a cancellation) may still be
    writing from a thread is dropped, never reused."""

    @staticmethod
    def buffers_for(io_threads: int) -> int:
        """How many part-sized buffers a TierIO of `io_threads` keeps (what host_memory counts for reads)."""
        return max(2, io_threads)

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


class TierReads(Protocol):
    """What the verified read needs of the tiers (TierIO gives it): two reads of one part from one tier, each
    with that tier's timeout and retries (`budgeted`: also its byte budget and a worker slot), and a thread."""

    async def read_into(self, tier: str, key: str, nbytes: int,
                        lend: Callable[[], ContextManager[list[memoryview]]], *, budgeted: bool = True) -> int: ...

    async def read_chunks(self, tier: str, key: str, chunk_size: int, length: int,
                          consume: Callable[[memoryview, int], bool], *, budgeted: bool = True) -> int | None: ...

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T: ...


async def read_verified(tiers_io: TierReads, bounce: BouncePool, part: PartRead, tiers: Sequence[str],
                        log: ReadLog, *, budgeted: bool = True) -> str:
    """Fill `part.views` from the first of `tiers` (in that order) that returns the part whole and with the
    expected checksum; return that tier's name. A `bounce` part goes through a buffer of `bounce`: its views
    receive only verified bytes, and its targets are added to `log.overwritten`. Each failed try is added to
    `log.fallbacks`; when none succeeds, raise IntegrityError naming every reason."""
    reasons = []
    for name in tiers:
        if part.bounce:
            async with bounce.slot:
                reason = await _try_bounced_read(tiers_io, bounce, name, part, budgeted)
            log.overwritten.update(part.targets if reason is None else part.touched)
        else:
            reason = await _try_read(tiers_io, name, part, budgeted)
        if reason is None:
            log.bytes_by_tier[name] = log.bytes_by_tier.get(name, 0) + part.length
            return name
        log.fallbacks.append(Fallback(part.key, name, reason))
        reasons.append(f"{name}: {reason}")
    raise IntegrityError(f"part {part.key}: no tier returned it intact "
                         f"({'; '.join(reasons) or 'no tier holds this checkpoint'})")


async def _try_chunked_read(tiers_io: TierReads, name: str, part: PartRead,
                            budgeted: bool) -> tuple[bool, str | None]:
    """Read the part a chunk at a time into a buffer that stays in cache (a tier of files can), check the
    chunk's digest, then copy it to `part.views`: one pass over memory, and no byte of a chunk reaches its
    destination before the chunk passed. A chunk that fails stops the read (the chunks before it are written,
    verified; the part is then read whole from the next tier). The chunk digests are the sealed record's, so
    they are enough for a load; `check_whole` also checks that the part's own checksum is the digest of those
    chunk digests (verify does). (False, None) when the tier cannot read it that way now."""
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
        fill(part.views, [chunk], at)
        written[0] = at + len(chunk)
        return True

    try:
        n = await tiers_io.read_chunks(name, part.key, size, part.length, consume, budgeted=budgeted)
    except TierError as e:
        return True, f"{type(e).__name__}: {e}"
    if n is None:
        return False, None
    reason = _chunked_failure(part, n, outcome, sums)
    if reason is not None and written[0]:  # verified chunks reached the destination before the failure: which
        # targets (the targets before the first that begins past what was written, found by bisection on the event
        # loop, never a walk over 100k of them: `target_starts` rise, as the targets lie in the part)
        reached = bisect.bisect_left(part.target_starts, written[0]) if part.target_starts else len(part.targets)
        part.touched = tuple(part.targets[:reached])
    return True, reason


def _chunked_failure(part: PartRead, n: int, outcome: list[str], sums: memoryview) -> str | None:
    """Why a part read a chunk at a time is not intact (None: it is)."""
    size = part.chunk_size
    if n != part.length:
        return f"length {n}, expected {part.length}"
    if outcome:
        return outcome[0]
    if len(sums) != 8 * (-(-part.length // size)):
        return f"{len(sums) // 8} chunk digests for {-(-part.length // size)} chunks"
    whole = of_chunk_digests(part.chunk_sums, part.algorithm) if part.check_whole else part.checksum
    if whole != part.checksum:  # the chunks are the record's: the part's checksum follows from their digests
        return (f"{describe(part.algorithm, whole)}, expected {describe(part.algorithm, part.checksum)} "
                f"(the record's chunk digests disagree)")
    return None


async def _try_bounced_read(tiers_io: TierReads, bounce: BouncePool, name: str, part: PartRead,
                            budgeted: bool) -> str | None:
    """Read `part` into a bounce buffer (a fresh one for every attempt, retries included), verify it, then copy
    it to `part.views`; None when that succeeded, else why not. A part with chunk digests is read a chunk at a
    time instead where the tier can (no bounce buffer, one pass)."""
    from ..buffers import tensor_bytes

    if part.chunk_size and part.chunk_sums:
        done, reason = await _try_chunked_read(tiers_io, name, part, budgeted)
        if done:
            return reason
    current: list[torch.Tensor] = []

    @contextlib.contextmanager
    def lend() -> Iterator[list[memoryview]]:
        buf = bounce.take(part.length)
        current[:] = [buf]
        try:
            yield [tensor_bytes(buf)[:part.length]]
        except BaseException:
            bounce.drop(buf)  # a thread may still be writing it (timeout, cancellation): never reuse it
            current.clear()
            raise

    try:
        n = await tiers_io.read_into(name, part.key, part.length, lend, budgeted=budgeted)
    except TierError as e:
        return f"{type(e).__name__}: {e}"
    buf = current[0]
    view = tensor_bytes(buf)[:part.length]
    reason = await _verify(tiers_io, [view], n, part)
    if reason is None:
        await tiers_io.run_blocking(fill, part.views, [view])
    bounce.give(buf)
    return reason


def fill(views: Sequence[memoryview] | Sinks, pieces: Sequence[bytes | memoryview], start: int = 0) -> None:
    """Copy `pieces` (the value's bytes from `start` on) into a part's buffers."""
    if isinstance(views, (list, tuple)):
        scatter(pieces, views, start)
    else:  # Sinks
        views.scatter(pieces, start)


async def _try_read(tiers_io: TierReads, name: str, part: PartRead, budgeted: bool) -> str | None:
    """None when `part` was read intact from tier `name` straight into `part.views`, else why not."""
    views = list(part.views)  # a driver reads into memoryviews (Sinks made into them here)
    try:
        n = await tiers_io.read_into(name, part.key, part.length, lambda: contextlib.nullcontext(views),
                                     budgeted=budgeted)
    except TierError as e:
        return f"{type(e).__name__}: {e}"
    return await _verify(tiers_io, views, n, part)


async def _verify(tiers_io: TierReads, views: list[memoryview], n: int, part: PartRead) -> str | None:
    if n != part.length:
        return f"length {n}, expected {part.length}"
    chunk_size = part.chunk_size if part.chunk_sums else 0  # format 4: the digest of the chunks' digests
    actual = await tiers_io.run_blocking(part_checksum, views, part.algorithm, chunk_size)
    if actual != part.checksum:
        return f"{describe(part.algorithm, actual)}, expected {describe(part.algorithm, part.checksum)}"
    return None
