"""Host staging buffers (staging_buffer.py), reused across saves.

Buffers are allocated once, touched once (first-touch page faults cost 4-5x a memcpy), and
then recycled: a save never allocates host memory proportional to the state after the first one.
At most `max_inflight` buffers are in flight; a save that needs one waits for a release, it never drops.
With an `Arena` (arena.py) a buffer is the memory tier's own files; it stays with the checkpoint it holds
there (`retain`) until retention retires it (`reclaim`). Host memory: at most keep_last (+ keep_best) + 1 +
max_inflight states, the bound the arena checks the tier's capacity against (`_take_home`).
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import torch

from .gather import Gatherer
from .staging_buffer import StagingBuffer

if TYPE_CHECKING:
    from .arena import Arena
    from .mapped import MappedParts
    from .plan import Plan

log = logging.getLogger(__name__)


def _fits(buf: StagingBuffer, nbytes: int) -> bool:
    """Whether a save of `nbytes` can take `buf` (acquire's rule: a mapped buffer must be exactly that size)."""
    return buf.capacity >= nbytes and (buf.files is None or buf.files.nbytes == nbytes)


class StagingPool:
    def __init__(self, max_inflight: int, *, pin: bool | None = None, arena: Arena | None = None, gpu_gather: int = 0):
        self.max_inflight = max_inflight
        self.gatherer = Gatherer(gpu_gather)  # GPU scratch where small CUDA tensors are gathered (gather.py)
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.arena = arena
        self._free: list[StagingBuffer] = []
        self._count = 0  # buffers in flight, free or being made (retained ones do not count)
        self._held: set[int] = set()  # ids of the buffers saves hold; with those being made for a save (_making),
        self._making = 0  # at most max_inflight
        self._retained: dict[int, StagingBuffer] = {}  # step → the buffer whose files hold it on the memory tier
        self.waiting = 0  # saves waiting for a buffer (backpressure at work)
        self.taking_back = 0  # retired files being moved home (each waits for readers that map them)
        self._preparing: asyncio.Future[None] | None = None  # the next save's buffer, made ahead (_prepare_next)
        self._cond = asyncio.Condition()

    @property
    def exhausted(self) -> bool:
        """The next save cannot take a buffer until a save in flight gives one back."""
        return self.held >= self.max_inflight or (not self._free and self._count >= self.max_inflight)

    @property
    def held(self) -> int:
        """Buffers that saves hold now (staging or persisting from them): at most max_inflight."""
        return len(self._held) + self._making

    async def acquire(self, nbytes: int) -> StagingBuffer:
        await self._drop_vanished()
        async with self._cond:
            self.waiting += 1
            try:
                await self._cond.wait_for(lambda: self.held < self.max_inflight
                                          and (self._free or self._count < self.max_inflight))
            finally:
                self.waiting -= 1
            buf = next((b for b in self._free if _fits(b, nbytes)), None)
            if buf is not None:
                self._free.remove(buf)
                buf.in_use = True
                stale = None
                self._held.add(id(buf))
            else:
                stale = self._free.pop() if self._free else None  # another size (the state changed): replace it
                if stale is None:
                    self._count += 1
                self._making += 1
        if buf is not None:
            try:
                if buf.files is None or await _intact(buf.files):
                    return buf
            except BaseException:  # cancelled during the check (a thread's, for many parts): the buffer goes back
                async with self._cond:
                    buf.in_use = False
                    self._held.discard(id(buf))
                    self._free.append(buf)
                    self._cond.notify()
                raise
            log.warning("a staging buffer's files in the memory tier were removed, truncated or replaced by someone "
                        "else; it is dropped and a new one made (staging into it would kill the process: SIGBUS)")
            stale, buf.in_use = buf, False
            self._held.discard(id(buf))
            self._making += 1
        try:
            if stale is not None:
                await self._discard(stale)
            buf = await asyncio.to_thread(self._new, nbytes)
            buf.in_use = True
            self._making -= 1
            self._held.add(id(buf))
            return buf
        except BaseException:
            async with self._cond:
                self._count -= 1
                self._making -= 1
                self._cond.notify()
            raise

    def _new(self, nbytes: int) -> StagingBuffer:
        if self.arena is not None:
            self.arena.check_fits(nbytes, self.max_inflight)
            try:
                return self.arena.new(nbytes, self.pin)
            except OSError as e:  # e.g. tmpfs full: the save still goes on, staged in anonymous memory
                log.warning("cannot stage in the memory tier's files (%s); staging in anonymous memory, and the "
                            "memory tier gets its own copy", e)
        return StagingBuffer(nbytes, self.pin)

    def missing(self, nbytes: int) -> int:
        """How many more buffers of `nbytes` the saves to come will use: max_inflight, and with the memory tier's
        files also the checkpoints it keeps (keep_last + keep_best). The checkpoint that retention retires only
        after the next commit needs none of its own: the next save's buffer is the one it gives back
        (prepare_next makes no more either). Free buffers of another size do not count (drop_unfit)."""
        most = self.max_inflight + (self.arena.held if self.arena is not None else 0)
        unfit = sum(not _fits(b, nbytes) for b in self._free)
        fitting_retained = sum(_fits(b, nbytes) for b in self._retained.values())
        return max(0, most - (self._count - unfit) - fitting_retained)

    async def settle(self) -> None:
        """Wait for the buffer being made ahead (prepare_next), if any: it is in `free` then."""
        if self._preparing is not None:
            await asyncio.wait([self._preparing])

    async def drop_unfit(self, nbytes: int) -> None:
        """Drop the free buffers that cannot take a state of `nbytes` (the state changed size since)."""
        async with self._cond:
            unfit = [b for b in self._free if not _fits(b, nbytes)]
            self._free = [b for b in self._free if _fits(b, nbytes)]
            self._count -= len(unfit)
            self._cond.notify()
        for buf in unfit:
            await self._discard(buf)

    async def reserve(self, nbytes: int, count: int, plan: Plan | None = None) -> None:
        """Make `count` buffers of `nbytes` now, populated, as free buffers (Engine.reserve): the first saves then
        take them instead of allocating while training waits. Unlike a save's own buffer, one that cannot be made
        in the memory tier's files (its tmpfs full) raises instead of falling back to anonymous memory. The
        buffers are kept as the pool keeps any (`_take_home`), as without a reservation. With `plan`, every free
        buffer also gets its views of the plan's tensors now (StagingBuffer.views_for: an object per tensor, made
        at set-up, not in a save)."""
        for buf in list(self._free) if plan is not None else ():
            await asyncio.to_thread(buf.views_for, plan)
        for _ in range(count):
            async with self._cond:
                self._count += 1
            try:
                buf = await asyncio.to_thread(self._make, nbytes, plan)
            except BaseException:
                async with self._cond:
                    self._count -= 1
                    self._cond.notify()
                raise
            async with self._cond:
                self._free.append(buf)
                self._cond.notify()

    def staging_bytes(self, nbytes: int) -> int:
        """Bytes of the buffers a state of `nbytes` keeps: free ones that fit it (drop_unfit drops the others),
        those holding the memory tier's checkpoints, and those held by saves in flight (`nbytes` each: the pool
        keeps no list of them)."""
        held = self._count - len(self._free)
        free = sum(b.capacity for b in self._free if _fits(b, nbytes))
        return free + sum(b.capacity for b in self._retained.values()) + held * nbytes

    def _make(self, nbytes: int, plan: Plan | None) -> StagingBuffer:
        if self.arena is None:
            buf = StagingBuffer(nbytes, self.pin)
        else:
            self.arena.check_fits(nbytes, self.max_inflight)
            buf = self.arena.new(nbytes, self.pin)
        if plan is not None:
            buf.views_for(plan)
        return buf

    async def release(self, buf: StagingBuffer) -> None:
        """A save is done with `buf` (a retained buffer stays with its checkpoint until `reclaim`)."""
        buf.in_use = False
        async with self._cond:
            self._held.discard(id(buf))
            self._cond.notify()
        if buf.step is not None:
            if buf.step not in self._retained:  # retired while its save still read it: free it now
                await self._take_home(buf, counted=False)
            return
        await self._take_home(buf, counted=True)

    async def retain(self, buf: StagingBuffer, step: int) -> None:
        """`buf`'s files now hold checkpoint `step` on the memory tier: it stays with it, and no longer counts
        against max_inflight (the next save may take another buffer). Saves still writing other tiers keep
        reading it; retention never retires a step that a save is writing."""
        async with self._cond:
            if buf.step is None:
                buf.step = step
                self._retained[step] = buf
                self._count -= 1
                self._held.discard(id(buf))
                self._cond.notify()

    def prepare_next(self, nbytes: int, plan: Plan | None = None) -> None:
        """A save just staged into the memory tier's files. While that tier is still filling up (fewer buffers
        than keep_last (+ keep_best) + max_inflight exist), make the next save's buffer now, in the background,
        while training runs: else each of the first keep_last + 1 saves would allocate and populate one (about
        1 s/GiB here) while the caller waits. Once the tier is full, retention hands retired checkpoints' files
        back instead, and nothing is made. Memory stays within keep_last (+ keep_best) + 1 + max_inflight
        states. With `plan`, the buffer's views of its tensors are made there too (not in the next save)."""
        if self.arena is None or self._preparing is not None or self._free:
            return
        if self._count + len(self._retained) >= self.arena.held + self.max_inflight:
            return
        self._count += 1  # counted now: a save arriving meanwhile waits for this buffer instead of making another
        self._preparing = asyncio.ensure_future(self._prepare(nbytes, plan))

    async def _prepare(self, nbytes: int, plan: Plan | None) -> None:
        try:  # `_preparing` is cleared only once the buffer is in _free (settle() and clear() wait for that)
            try:
                buf = await asyncio.to_thread(self._new, nbytes)
            except BaseException as e:
                async with self._cond:
                    self._count -= 1
                    self._cond.notify()
                if not isinstance(e, asyncio.CancelledError):
                    log.warning("the next staging buffer could not be made ahead (%s); the next save makes it", e)
                return
            try:  # else the next save makes the views while training waits
                if plan is not None:
                    await asyncio.to_thread(buf.views_for, plan)
            except Exception as e:  # (it makes them again then)
                log.warning("the next staging buffer's views could not be made ahead: %s", e)
            finally:  # cancelled or not, the buffer is counted: it goes where clear() finds it
                self._free.append(buf)
            async with self._cond:
                self._cond.notify()
        finally:
            self._preparing = None

    async def reclaim(self, tier: str, step: int) -> None:
        """Retention retires `step` from `tier`: if a buffer holds it, its files come home as a free buffer."""
        if self.arena is None or tier != self.arena.name or step not in self._retained:
            return
        buf = self._retained.pop(step)
        if not buf.in_use:  # else its save frees it at release
            await self._take_home(buf, counted=False)

    async def _take_home(self, buf: StagingBuffer, *, counted: bool) -> None:
        """`buf` is free again: kept for the next save while the pool holds fewer buffers than it may, else dropped
        (a burst must not leave buffers behind). It may hold max_inflight; with the memory tier's files also what
        that tier holds at most, keep_last (+ keep_best) + 1 (retention retires the oldest after the next
        commit), the bound its `capacity` is checked against. A checkpoint retired while the next save already
        made its buffer (two saves back to back, as Lightning's top-k and last.ckpt) is then kept for the save
        after, instead of that save making one more. `counted`: it still counts in `_count`."""
        reusable = True
        try:
            if buf.files is not None and self.arena is not None:
                self.taking_back += 1
                try:
                    reusable = await asyncio.to_thread(self.arena.take_back, buf)
                finally:
                    self.taking_back -= 1
        except Exception as e:
            log.warning("a staging buffer could not be taken back (%s); it is dropped", e)
            reusable = False
        finally:
            buf.step = None
            async with self._cond:
                most = self.max_inflight + (self.arena.held + 1 if self.arena is not None else 0)
                keep = reusable and (self._count - counted) + len(self._retained) < most
                if keep:
                    self._free.append(buf)
                    self._count += not counted
                else:
                    self._count -= counted
                self._cond.notify()
        if not keep:
            await self._discard(buf)

    async def _drop_vanished(self) -> None:
        """Retained buffers whose files someone else deleted (e.g. `tiered-ckpt delete` in another process):
        their memory stays mapped until dropped here."""
        gone = [step for step, buf in self._retained.items()
                if not buf.in_use and buf.files is not None and not buf.files.intact()]
        for step in gone:
            buf = self._retained.pop(step)
            buf.step = None
            await self._discard(buf)

    async def _discard(self, buf: StagingBuffer) -> None:
        """Drop a buffer: its files (if not the tier's) go, and its memory is unmapped, in a thread (hundreds of
        ms for a large state)."""
        await asyncio.to_thread(buf.drop)

    async def clear(self) -> None:
        if self._preparing is not None:
            await asyncio.wait([self._preparing])  # (a buffer in the making: it lands in _free, then goes)
        free, self._free = self._free, []
        for buf in free:
            await self._discard(buf)
        retained = [b for b in self._retained.values() if not b.in_use]
        self._retained.clear()  # their files stay (the memory tier's checkpoints); their memory and views go in a
        for buf in retained:  # thread, not wherever the last reference goes (the loop: seconds at 1M tensors)
            await asyncio.to_thread(buf.unmap)
        del retained
        self._count = 0
        self.gatherer.clear()
        if self.arena is not None:
            await asyncio.to_thread(self.arena.release_claim)

    @property
    def held_bytes(self) -> int:
        return sum(b.capacity for b in self._free)

    @property
    def buffers(self) -> int:
        """Buffers in flight or free: what counts against max_inflight (retained ones do not)."""
        return self._count

    @property
    def free(self) -> tuple[StagingBuffer, ...]:
        """Buffers waiting for the next save."""
        return tuple(self._free)

    @property
    def retained(self) -> dict[int, StagingBuffer]:
        """step → the buffer whose files hold that checkpoint on the memory tier (a copy of the mapping)."""
        return dict(self._retained)


async def _intact(files: MappedParts) -> bool:
    """`files.intact()`: a stat per part file, on the loop for a few parts (tmpfs answers in microseconds; a trip
    to a thread costs more, and a save waits for it before its first copy), in a thread for many."""
    return files.intact() if len(files.paths) <= 16 else await asyncio.to_thread(files.intact)
