"""Where each tier of a save reads a part's bytes from: the staging buffer while the save holds it, else the
fastest tier that already holds the part (checksum-verified).

When the next save needs the buffer (max_inflight reached), the save *detaches*: once every part sits on
at least one tier and no writer is reading the buffer, the buffer goes back to the pool, and tiers still
behind read each part back from a tier that has it. So the memory tier absorbs a burst of saves while the
disk keeps streaming, and a save never waits for the slowest tier unless nothing faster holds its parts.
A buffer that is the memory tier's own files (arena.py) never detaches: it stays with the checkpoint.
"""
from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import AsyncIterator

import torch

from ..buffers import tensor_bytes
from ..errors import IntegrityError
from ..layout import PartKey
from ..storage.tier_io import TierIO
from ..storage.verified_read import PartRead, ReadLog
from .pool import StagingPool
from .records import Records
from .staging_buffer import StagingBuffer


class PartSource:
    """One save's parts as the tiers read them: from the staging `buffer` (leased from `pool`) while the save
    holds it, else from a tier that holds the part. `records` gives each part's checksums (and says when the
    hashing threads are done with the buffer); `tiers` are the tiers this save writes."""

    def __init__(self, io: TierIO, pool: StagingPool, buffer: StagingBuffer, records: Records, tiers: list[str]):
        self.io = io
        self.pool = pool
        self.records = records
        self.plan = plan = records.plan
        self.buffer: StagingBuffer | None = buffer
        self.job, self.step, self.incarnation = records.commit.job, records.step, records.commit.incarnation
        n = plan.num_parts
        self._holders: list[list[str]] = [[] for _ in range(n)]  # per part: the tiers that hold it
        self._pending = [len(tiers)] * n  # tier writes not yet settled, per part
        self._unsafe = n  # parts on no tier while a tier may still write them
        self._safe = asyncio.Event()
        if n == 0:
            self._safe.set()
        self._readers = 0
        self._readers_cond = asyncio.Condition()
        self._detached = False
        self._detach_task: asyncio.Task[None] | None = None
        self._read_back_parts = 0
        arena = pool.arena
        # the tier whose files this buffer is (a memory tier first in the stack), if any
        self.files_tier = arena.name if arena is not None and buffer.files is not None and arena.name in tiers else None

    def key(self, p: int) -> str:
        return PartKey(self.job, self.step, self.plan.rank, p, self.incarnation).path

    def settled(self, p: int, tier: str, ok: bool) -> None:
        """`tier` is done with part p (`ok`: it holds it now). The part is safe once a tier holds it, and lost
        for good once every tier is done and none holds it: either way nobody waits on it any more."""
        if ok:
            self._holders[p].append(tier)
        self._pending[p] -= 1
        if (ok and len(self._holders[p]) == 1) or (not ok and self._pending[p] == 0 and not self._holders[p]):
            self._unsafe -= 1
            if self._unsafe == 0:
                self._safe.set()

    def settled_all(self, tier: str, ok: bool) -> None:
        for p in range(self.plan.num_parts):
            self.settled(p, tier, ok)

    @asynccontextmanager
    async def part(self, p: int) -> AsyncIterator[memoryview]:
        """Part p's bytes for as long as the context lasts."""
        a, b = self.plan.part_range(p)
        if not self._detached:
            assert self.buffer is not None
            self._readers += 1
            try:
                yield self.buffer.view[a:b]
            finally:
                async with self._readers_cond:
                    self._readers -= 1
                    self._readers_cond.notify_all()
            return
        async with self.io.bounce.slot:
            buf = await self._read_back(p, b - a)
            try:
                yield tensor_bytes(buf)[: b - a]
            except BaseException:
                self.io.bounce.drop(buf)  # an abandoned write may still read it from a thread
                raise
            self.io.bounce.give(buf)
            self._read_back_parts += 1

    async def _read_back(self, p: int, length: int) -> torch.Tensor:
        """The staging buffer is gone: fetch part p from the fastest tier holding it, verified, with that
        tier's timeout and retries, into a bounce buffer. Its bytes are already counted in the writing tier's
        budget; taking the holder's budget as well could deadlock two tiers that read back from each other."""
        (expected, chunk_sums), reasons = (await self.records.part_sums())[p], []
        for tier in self.io.order(self._holders[p]):
            buf = self.io.bounce.take(length)
            try:
                part = PartRead(self.key(p), [tensor_bytes(buf)[:length]], length, expected, algorithm=self.records.algorithm,
                                chunk_size=self.records.chunk_size if chunk_sums else 0, chunk_sums=chunk_sums)
                await self.io.read_verified(part, [tier], ReadLog(), budgeted=False)
                return buf
            except IntegrityError as e:
                self.io.bounce.drop(buf)  # a timed-out read may still write it
                reasons.append(str(e))
        raise IntegrityError(f"part {self.key(p)} is no longer staged and no tier returned it intact "
                             f"({'; '.join(reasons)})")

    # -- giving the staging buffer back ----------------------------------------------------------
    def request_detach(self) -> None:
        """Give the staging buffer back early (the next save needs it). A buffer that is the memory tier's
        files cannot go back: it stays with the checkpoint, and the pool lets the next save take another."""
        if self.buffer is None or self.buffer.files is not None:
            return
        if self._detach_task is None:
            self._detach_task = asyncio.create_task(self._detach())

    async def _detach(self) -> None:
        await self._safe.wait()
        async with self._readers_cond:
            await self._readers_cond.wait_for(lambda: self._readers == 0)
            self._detached = True
        await self.release()

    async def release(self) -> None:
        """The save is done with the buffer (idempotent)."""
        await self.records.hashing_done()  # hashing threads read the buffer until they finish
        buffer, self.buffer = self.buffer, None
        if buffer is not None:
            self._detached = True
            await self.pool.release(buffer)

    async def finish(self) -> None:
        """Every tier is done: the buffer goes back, and part-sized buffers that read-backs used are freed
        (in a thread)."""
        await self.release()
        if self._read_back_parts:
            self._read_back_parts = 0
            await self.io.run_blocking(self.io.bounce.clear)

    async def retain(self) -> None:
        """The buffer's files now hold this checkpoint on the memory tier: it stays with it (pool.retain)."""
        if self.buffer is not None:
            await self.pool.retain(self.buffer, self.step)
