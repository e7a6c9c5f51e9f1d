"""One save in flight: SaveHandle (what the caller holds) and SaveJob (what the engine runs).

Flow of a part: it is written to every targeted tier, all tiers at once, each through its own pipeline.
While the staging buffer is held, every tier reads the part from it. When the next save needs the buffer
(max_inflight reached), the job *detaches*: once every part sits on at least one tier and no writer is
reading the buffer, the buffer goes back to the pool, and tiers still behind read each part from the
fastest tier that already holds it (checksum-verified). So the memory tier absorbs a burst of saves while
the disk keeps streaming, and a save never waits for the slowest tier unless nothing faster holds its parts.
"""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, AsyncIterator

from .checksum import ALGORITHM, checksum
from .errors import IntegrityError, RankFailed, SaveError, TierError, TierNotFound, TierTimeout
from .manifest import Manifest, RankMeta
from .plan import Plan
from .staging import StagingBuffer, stage
from .state import FlatState, encode_skeleton
from .tiers.base import PartKey, Tier, manifest_key, rank_meta_key

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger(__name__)


def _quiet(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()  # mark retrieved; the handle or the engine reports it


class SaveHandle:
    """Returned by Engine.save. `staged()`: the state may be mutated. `wait()`: every targeted tier done."""

    def __init__(self, step: int, tiers: list[str]):
        loop = asyncio.get_running_loop()
        self.step = step
        self.tiers = tuple(tiers)
        self._staged: asyncio.Future[None] = loop.create_future()
        self._done: dict[str, asyncio.Future[None]] = {t: loop.create_future() for t in tiers}
        for f in (self._staged, *self._done.values()):
            f.add_done_callback(_quiet)
        self.observed = False
        self.started = time.perf_counter()
        self.durable_at: dict[str, float] = {}  # seconds from save() to durable, per tier

    async def staged(self) -> None:
        """Return once the tensors are copied to host buffers (raise if staging failed)."""
        await asyncio.shield(self._staged)

    async def wait(self, tier: str | None = None) -> None:
        """Wait for one tier, or all; raise the tier's error, or SaveError naming every failed tier."""
        self.observed = True
        if tier is not None:
            if tier not in self._done:
                raise ValueError(f"step {self.step} does not target tier {tier!r} (targets: {list(self.tiers)})")
            await asyncio.shield(self._done[tier])
            return
        await self.staged()
        if self._done:
            await asyncio.wait(self._done.values())
        if self.errors:
            raise SaveError(self.step, self.errors)

    def done(self) -> bool:
        return self._staged.done() and all(f.done() for f in self._done.values())

    @property
    def errors(self) -> dict[str, BaseException]:
        return {t: f.exception() for t, f in self._done.items()
                if f.done() and not f.cancelled() and f.exception() is not None}

    def _set(self, fut: asyncio.Future[None], error: BaseException | None) -> None:
        if fut.done():
            return
        fut.set_exception(error) if error is not None else fut.set_result(None)

    def __repr__(self) -> str:
        state = "done" if self.done() else "staged" if self._staged.done() else "staging"
        return f"<SaveHandle step={self.step} tiers={list(self.tiers)} {state}>"


class SaveJob:
    def __init__(self, engine: "Engine", step: int, flat: FlatState, plan: Plan, buffer: StagingBuffer,
                 handle: SaveHandle, tiers: list[Tier], metadata: dict[str, Any]):
        self.engine = engine
        self.step = step
        self.flat = flat
        self.plan = plan
        self.buffer: StagingBuffer | None = buffer
        self.handle = handle
        self.tiers = tiers
        self.metadata = metadata
        n = plan.num_parts
        self._holders: list[list[str]] = [[] for _ in range(n)]
        self._pending = [len(tiers)] * n  # tier writes not yet finished, per part
        self._unsafe = n  # parts on no tier while a tier may still write them
        self._safe = asyncio.Event()
        if n == 0:
            self._safe.set()
        self._readers = 0
        self._readers_cond = asyncio.Condition()
        self._detached = False
        self._detach_task: asyncio.Task[None] | None = None
        self._checksums: asyncio.Task[list[int]] | None = None
        self._manifest: asyncio.Task[bytes] | None = None
        self._rank_meta: asyncio.Task[bytes] | None = None
        self.task: asyncio.Task[None] | None = None

    # -- staging ---------------------------------------------------------------------------------
    async def stage(self) -> None:
        try:
            await self.engine.run_blocking(stage, self.plan, self.flat.tensors, self.buffer)
        except BaseException as e:
            self.handle._set(self.handle._staged, e)
            raise
        self.handle._set(self.handle._staged, None)
        self.flat.tensors = []  # drop references to the caller's tensors

    # -- the background run ----------------------------------------------------------------------
    async def run(self, staging: asyncio.Task[None]) -> None:
        engine = self.engine
        try:
            try:
                await staging
            except BaseException as e:
                for tier in self.tiers:
                    self.handle._set(self.handle._done[tier.name], await self._report(tier, e))
                return
            self._checksums = asyncio.create_task(self._compute_checksums())
            try:
                await engine._begin(self.step, [t.name for t in self.tiers])
            except BaseException as e:
                for fut in self.handle._done.values():
                    self.handle._set(fut, e)
                return
            await asyncio.gather(*(self._persist_tier(t) for t in self.tiers))
        finally:
            await self._release_buffer()

    async def _compute_checksums(self) -> list[int]:
        assert self.buffer is not None
        view = self.buffer.view
        ranges = [self.plan.part_range(p) for p in range(self.plan.num_parts)]
        return list(await asyncio.gather(
            *(self.engine.run_blocking(checksum, [view[a:b]]) for a, b in ranges)))

    async def manifest_bytes(self) -> bytes:
        """The manifest (rank 0 only), stored in the index once and returned for every tier."""
        if self._manifest is None:
            self._manifest = asyncio.create_task(self._build_manifest())
        return await asyncio.shield(self._manifest)

    async def _build_manifest(self) -> bytes:
        plan, engine = self.plan, self.engine
        manifest = Manifest(
            job=engine.job, step=self.step, world_size=plan.world_size, part_size=plan.part_size,
            checksum=ALGORITHM, tensors=plan.tensors,
            ranks=tuple(RankMeta(r, n) for r, n in enumerate(plan.rank_nbytes)),
            skeleton=encode_skeleton(self.flat.skeleton), created=time.time(), metadata=self.metadata)
        data = manifest.to_bytes()
        await engine.index.put_manifest(engine.job, self.step, data)
        return data

    async def rank_meta_bytes(self) -> bytes:
        """This rank's part checksums, stored in the index once and returned for every tier."""
        if self._rank_meta is None:
            self._rank_meta = asyncio.create_task(self._build_rank_meta())
        return await asyncio.shield(self._rank_meta)

    async def _build_rank_meta(self) -> bytes:
        assert self._checksums is not None
        data = RankMeta(self.plan.rank, self.plan.nbytes, tuple(await self._checksums)).to_bytes()
        await self.engine.index.put_rank_meta(self.engine.job, self.step, self.plan.rank, data)
        return data

    async def _persist_tier(self, tier: Tier) -> None:
        engine, handle = self.engine, self.handle
        pipeline = engine.pipelines[tier.name]
        rank, world = self.plan.rank, self.plan.world_size
        error: BaseException | None = None
        try:
            results = await asyncio.gather(*(
                pipeline.submit(b - a, lambda p=p: self._write_part(tier, p), f"write part {p} of step {self.step}")
                for p, (a, b) in ((p, self.plan.part_range(p)) for p in range(self.plan.num_parts))
            ), return_exceptions=True)
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed:
                raise failed[0]
            blobs = [(rank_meta_key(engine.job, self.step, rank), await self.rank_meta_bytes())]
            if rank == 0:
                blobs.append((manifest_key(engine.job, self.step), await self.manifest_bytes()))
            for key, data in blobs:
                await pipeline.submit(len(data), lambda k=key, d=data: tier.write(k, memoryview(d)), f"write {key}")
            written = [PartKey(engine.job, self.step, rank, p).path for p in range(self.plan.num_parts)]
            gone = await tier.missing(written + [key for key, _ in blobs])
            if gone:  # e.g. a cache that restarted empty mid-save: never commit what is no longer there
                raise TierNotFound(f"step {self.step}: {len(gone)} value(s) vanished before the commit, "
                                   f"first {gone[0]}", tier=tier.name)
            await engine.index.mark_durable(engine.job, self.step, tier.name, rank, world, engine.session)
            engine._complete.add(self.step)  # saving this step again is refused from now on
            if world > 1:
                await self._wait_for_every_rank(tier)
        except Exception as e:
            error = await self._report(tier, e)
        handle.durable_at[tier.name] = time.perf_counter() - handle.started
        if error is None:
            await engine._retain(tier, finishing=self.step)
        handle._set(handle._done[tier.name], error)

    async def _report(self, tier: Tier, e: BaseException) -> BaseException:
        """Record this rank's failure on `tier` where every rank sees it; return the error to raise."""
        engine, rank = self.engine, self.plan.rank
        if isinstance(e, RankFailed):  # another rank's failure, already recorded
            return e
        reason = f"{type(e).__name__}: {e}"
        log.error("checkpoint step %d failed on tier %s (rank %d): %s", self.step, tier.name, rank, reason)
        try:
            await engine.index.mark_failed(engine.job, self.step, tier.name, rank, engine.session, reason)
        except Exception as e2:  # the index being down must not hide the original error
            log.error("could not record the failure of tier %s in the index: %s", tier.name, e2)
        if self.plan.world_size == 1:
            return e
        error = RankFailed(f"step {self.step}: rank {rank}: {reason}", tier=tier.name)
        error.__cause__ = e
        return error

    async def _wait_for_every_rank(self, tier: Tier) -> None:
        """Resolve when every rank's parts are durable on `tier`; raise the first rank's recorded failure,
        or a timeout naming the ranks that never reported (a killed rank records nothing)."""
        engine = self.engine
        deadline = time.monotonic() + engine.config.engine.commit_timeout
        delay = 0.005
        while True:
            state = await engine.index.tier_state(engine.job, self.step, tier.name, engine.session)
            if state.state == "complete":
                return
            if state.state == "failed":
                raise RankFailed(f"step {self.step}: {state.reason}", tier=tier.name)
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.plan.world_size)) - state.ranks_done)
                raise TierTimeout(f"step {self.step} not complete after {engine.config.engine.commit_timeout}s: "
                                  f"ranks {missing} never reported their parts durable", tier=tier.name)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.25)

    async def _write_part(self, tier: Tier, p: int) -> None:
        key = PartKey(self.engine.job, self.step, self.plan.rank, p).path
        ok = False
        try:
            async with self._part_bytes(p) as data:
                await tier.write(key, data)
            ok = True
            self._holders[p].append(tier.name)
        finally:
            self._pending[p] -= 1
            if (ok and len(self._holders[p]) == 1) or (not ok and self._pending[p] == 0 and not self._holders[p]):
                self._unsafe -= 1
                if self._unsafe == 0:
                    self._safe.set()

    @asynccontextmanager
    async def _part_bytes(self, p: int) -> AsyncIterator[memoryview]:
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
        yield await self._read_back(p, b - a)

    async def _read_back(self, p: int, length: int) -> memoryview:
        """The staging buffer is gone: fetch part p from the fastest tier holding it, verified."""
        assert self._checksums is not None
        expected = (await self._checksums)[p]
        key = PartKey(self.engine.job, self.step, self.plan.rank, p).path
        reasons = []
        for name in self.engine.tier_order(self._holders[p]):
            buf = memoryview(bytearray(length))
            try:
                n = await self.engine.tiers[name].read_into(key, [buf])
            except TierError as e:
                reasons.append(f"{name}: {e}")
                continue
            if n == length and await self.engine.run_blocking(checksum, [buf]) == expected:
                return buf
            reasons.append(f"{name}: length {n} or checksum differs")
        raise IntegrityError(f"part {key} is no longer staged and no tier returned it intact ({'; '.join(reasons)})")

    # -- giving the staging buffer back ----------------------------------------------------------
    def request_detach(self) -> None:
        if self._detach_task is None and self.buffer is not None:
            self._detach_task = asyncio.create_task(self._detach())

    async def _detach(self) -> None:
        await self._safe.wait()
        async with self._readers_cond:
            await self._readers_cond.wait_for(lambda: self._readers == 0)
            self._detached = True
        await self._release_buffer()

    async def _release_buffer(self) -> None:
        if self._checksums is not None:
            await asyncio.wait([self._checksums])  # its threads read the buffer until they finish
        buffer, self.buffer = self.buffer, None
        if buffer is not None:
            self._detached = True
            await self.engine.pool.release(buffer)
