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
import concurrent.futures
import logging
import os
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Mapping

from ..checksum import checksum
from .commit import Committer, Superseded
from ..errors import IndexUnavailable, IntegrityError, SaveError, TierError, TierFull, TierNotFound
from ..layout import PartKey, manifest_key, rank_meta_key, rank_prefix
from ..manifest import Manifest, RankMeta
from .plan import Plan
from ..lifecycle.retention import Retention
from .pool import StagingBuffer, StagingPool, stage
from ..state import FlatState, encode_skeleton
from ..storage.tier_io import PartRead, ReadLog, TierIO


# Checksum parts while later ones are still being copied, when the machine has cores to spare. With two
# cores the hashing threads compete with the copy for the only other core and for memory bandwidth (measured:
# save() blocking +15%, durable on the memory tier -15%), so there the parts are hashed after the copy.
HASH_WHILE_STAGING = (os.cpu_count() or 1) > 2


def _quiet(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()  # mark retrieved; the handle or the engine reports it


log = logging.getLogger(__name__)


def _resolve(fut: asyncio.Future[None], error: BaseException | None) -> None:
    if not fut.done():
        fut.set_exception(error) if error is not None else fut.set_result(None)


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
        self.skipped: dict[str, int] = {}  # tiers that could not keep up and skipped this save → the newer step

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

    def done_except(self, tier: str) -> bool:
        return self._staged.done() and all(f.done() for t, f in self._done.items() if t != tier)

    @property
    def errors(self) -> dict[str, BaseException]:
        out: dict[str, BaseException] = {}
        for tier, f in self._done.items():
            if f.cancelled():
                out[tier] = asyncio.CancelledError("the save was cancelled before it finished on this tier")
            elif f.done() and f.exception() is not None:
                out[tier] = f.exception()  # type: ignore[assignment]
        return out

    def set_staged(self, error: BaseException | None = None) -> None:
        _resolve(self._staged, error)

    def set_done(self, tier: str, error: BaseException | None = None) -> None:
        _resolve(self._done[tier], error)

    def set_skipped(self, tier: str, newer: int) -> None:
        """Done on `tier` without writing it: a newer save superseded this one there (not an error)."""
        self.skipped[tier] = newer
        _resolve(self._done[tier], None)

    def cancel(self) -> None:
        for fut in (self._staged, *self._done.values()):
            fut.cancel()

    def __repr__(self) -> str:
        state = "done" if self.done() else "staged" if self._staged.done() else "staging"
        return f"<SaveHandle step={self.step} tiers={list(self.tiers)} {state}>"


@dataclass(frozen=True)
class SaveServices:
    """What a save job uses of the engine, and nothing more."""

    tiers: TierIO
    commit: Committer
    retention: Retention
    pool: StagingPool
    checksum: str = "crc32c"  # the parts' checksum algorithm for new checkpoints (checksum.resolve)


class SaveJob:
    """One save in flight: stage, then for every targeted tier at once: parts, records, commit, retention."""

    def __init__(self, services: SaveServices, step: int, flat: FlatState, plan: Plan, buffer: StagingBuffer,
                 handle: SaveHandle, tiers: list[str], metadata: dict[str, Any], events: Mapping[Any, Any]):
        self.io = services.tiers
        self.commit = services.commit
        self.retention = services.retention
        self.pool = services.pool
        self.algorithm = services.checksum
        self.job = services.commit.job
        self.step = step
        self.flat = flat
        self.plan = plan
        self.buffer: StagingBuffer | None = buffer
        self.handle = handle
        self.tiers = tiers
        self.metadata = metadata
        self.events = events  # CUDA: the producer streams' state at save() time (staging.producer_events)
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
        self._part_sums: list[concurrent.futures.Future[int]] = []  # submitted as parts are staged
        self._manifest: asyncio.Task[bytes] | None = None
        self._rank_meta: asyncio.Task[bytes] | None = None
        self._encoded_skeleton: bytes | None = None
        self._failed: dict[str, BaseException] = {}  # tier → this save's error there
        self._marked: set[str] = set()  # tiers on which this rank marked its parts durable
        self._staged_tier: str | None = None  # the memory tier whose files the staging buffer is (see _persist_tier)
        self._staged_marked = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Stage (in a thread) and persist in the background; `handle.staged()` resolves after the copy."""
        staging = asyncio.create_task(self._stage())
        self.task = asyncio.create_task(self._run(staging))

    # -- staging ---------------------------------------------------------------------------------
    async def _stage(self) -> None:
        try:
            await self.io.run_blocking(stage, self.plan, self.flat.tensors, self.buffer, self.events,
                                       self._part_staged if HASH_WHILE_STAGING else None)
        except BaseException as e:
            self.handle.set_staged(e)
            raise
        self.handle.set_staged()
        self.flat.tensors = []  # drop references to the caller's tensors

    # -- the background run ----------------------------------------------------------------------
    async def _run(self, staging: asyncio.Task[None]) -> None:
        try:
            try:
                await staging
            except asyncio.CancelledError:
                raise
            except BaseException as e:
                for tier in self.tiers:
                    self.handle.set_done(tier, await self.commit.fail_tier(self.step, tier, e))
                return
            self._checksums = asyncio.create_task(self._compute_checksums())
            try:
                await self.retention.clear_crashed_attempt(self.step)
                await self.commit.begin(self.step, self.tiers, nbytes=sum(self.plan.rank_nbytes), metadata=self.metadata)
            except Exception as e:
                for tier in self.tiers:
                    self.handle.set_done(tier, e)
                return
            self._staged_tier = next((t for t in self.tiers if self._staged_on(t)), None)
            await asyncio.gather(*(self._persist_tier(t) for t in self.tiers))
            await self._remove_from_failed_tiers()
            await self._release_buffer()
            await self.retention.revisit()
        except asyncio.CancelledError:
            self.handle.cancel()  # nobody waits forever on a save that will never finish
            raise
        finally:
            await self._release_buffer()

    def _part_staged(self, up_to: int) -> None:
        """From the staging thread: every part that ends at or before `up_to` is staged: checksum it now, in
        another thread, while the copy goes on (on two cores: copy and hash overlap)."""
        assert self.buffer is not None
        view = self.buffer.view
        while len(self._part_sums) < self.plan.num_parts:
            a, b = self.plan.part_range(len(self._part_sums))
            if b > up_to:
                break
            self._part_sums.append(self.io.submit_blocking(checksum, [view[a:b]], self.algorithm))

    async def _compute_checksums(self) -> list[int]:
        assert self.buffer is not None
        self._part_staged(self.buffer.view.nbytes)  # (a staging path that did not report progress)
        return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in self._part_sums)))

    async def _manifest_bytes(self) -> bytes:
        """The manifest (rank 0 only), stored in the index once and returned for every tier."""
        if self._manifest is None:
            self._manifest = asyncio.create_task(self._build_manifest())
        return await asyncio.shield(self._manifest)

    async def _build_manifest(self) -> bytes:
        plan = self.plan
        manifest = Manifest(
            job=self.job, step=self.step, world_size=plan.world_size, part_size=plan.part_size,
            checksum=self.algorithm, tensors=plan.tensors,
            ranks=tuple(RankMeta(r, n) for r, n in enumerate(plan.rank_nbytes)),
            skeleton=b"",  # each rank's record carries its own skeleton
            created=time.time(), metadata=self.metadata, index=self.commit.index.identity,
            incarnation=self.commit.incarnation)
        data = await asyncio.to_thread(manifest.to_bytes)  # 100k tensors: ~0.3 s of Python, off the loop
        await self.commit.put_manifest(self.step, data)
        return data

    async def _skeleton(self) -> bytes:
        if self._encoded_skeleton is None:
            self._encoded_skeleton = await asyncio.to_thread(encode_skeleton, self.flat.skeleton)
        return self._encoded_skeleton

    async def _rank_meta_bytes(self) -> bytes:
        """This rank's part checksums, stored in the index once and returned for every tier."""
        if self._rank_meta is None:
            self._rank_meta = asyncio.create_task(self._build_rank_meta())
        return await asyncio.shield(self._rank_meta)

    async def _build_rank_meta(self) -> bytes:
        assert self._checksums is not None
        record = RankMeta(self.plan.rank, self.plan.nbytes, tuple(await self._checksums), await self._skeleton())
        data = await asyncio.to_thread(record.to_bytes)
        await self.commit.put_rank_meta(self.step, data)
        return data

    async def _persist_tier(self, tier: str) -> None:
        """With the staging buffer being the memory tier's files, the other tiers start once this rank has
        marked the memory tier durable (tens of ms): else its index writes (fsync on a file index) queue
        behind their writeback on the same file system, and the memory tier commits 3-5x later."""
        if self._staged_tier is None:
            await self._take_turn_and_write(tier)
        elif tier == self._staged_tier:
            try:
                await self._take_turn_and_write(tier)
            finally:
                self._staged_marked.set()
        else:
            await self._staged_marked.wait()
            await self._take_turn_and_write(tier)

    async def _take_turn_and_write(self, tier: str) -> None:
        """Wait for this save's turn on the tier; a newer save may supersede it meanwhile (or another rank
        may have skipped it), and then the tier skips it. Else write it; the turn passes on once this rank's
        parts and records are written, so the next save writes while this one waits for its commit."""
        turns = self.io.pipelines[tier].turns
        newer = await turns.take(self.step)
        if newer is not None:
            await self.commit.skip_tier(self.step, tier, newer)
            self._skip(tier, newer)
            return
        given = False

        def give_turn() -> None:
            nonlocal given
            if not given:
                given = True
                turns.give()

        try:
            try:
                newer = await self.commit.skipped(self.step, tier)
            except Exception:  # the index is down: write, and let the commit name the problem
                newer = None
            if newer is not None:
                self._skip(tier, newer)
                return
            await self._write_tier(tier, give_turn)
        finally:
            give_turn()

    def _staged_on(self, tier: str) -> bool:
        """The staging buffer is `tier`'s own files (a memory tier first in the stack): no part to write."""
        arena = self.pool.arena
        return arena is not None and arena.name == tier and self.buffer is not None and self.buffer.parts is not None

    async def _publish_staged(self, tier: str) -> None:
        assert self.pool.arena is not None and self.buffer is not None
        keys = [self._part_key(p) for p in range(self.plan.num_parts)]
        try:
            try:
                await self.io.run_blocking(self.pool.arena.publish, self.buffer, keys)
            except TierFull:  # the tier's older checkpoints may be retirable now: make room once, then retry
                await self.retention.apply(tier, finishing=self.step)
                await self.io.run_blocking(self.pool.arena.publish, self.buffer, keys)
        except TierError:
            raise
        except OSError as e:
            raise TierError(f"publishing the staged parts of step {self.step}: {e}", tier=tier) from e
        for p in range(self.plan.num_parts):
            self._holders[p].append(tier)
            self._settled(p, ok=True)

    def _skip(self, tier: str, newer: int) -> None:
        for p in range(self.plan.num_parts):
            self._settled(p, ok=False)
        self.handle.durable_at[tier] = time.perf_counter() - self.handle.started
        self.handle.set_skipped(tier, newer)

    async def _write_tier(self, tier: str, give_turn: Callable[[], None]) -> None:
        """Parts, then records (checksums; the manifest from rank 0), then a check that nothing vanished,
        then the commit; retention once the tier is complete."""
        handle, rank = self.handle, self.plan.rank
        error: BaseException | None = None
        staged_here = self._staged_on(tier)
        try:
            if staged_here:
                await self._publish_staged(tier)
            else:
                results = await asyncio.gather(*(
                    self.io.pipelines[tier].submit(b - a, lambda p=p: self._write_part(tier, p),
                                                   f"write part {p} of step {self.step}")
                    for p, (a, b) in ((p, self.plan.part_range(p)) for p in range(self.plan.num_parts))
                ), return_exceptions=True)
                failed = [r for r in results if isinstance(r, BaseException)]
                if failed:
                    raise failed[0]
            blobs = [(rank_meta_key(self.job, self.step, rank, self.commit.incarnation), await self._rank_meta_bytes())]
            if rank == 0:
                blobs.append((manifest_key(self.job, self.step, self.commit.incarnation), await self._manifest_bytes()))
            for key, data in blobs:
                await self.io.write(tier, key, memoryview(data))
            give_turn()
            written = [self._part_key(p) for p in range(self.plan.num_parts)]
            gone = await self.io[tier].missing(written + [key for key, _ in blobs])
            if gone:  # e.g. a cache that restarted empty mid-save: never commit what is no longer there
                raise TierNotFound(f"step {self.step}: {len(gone)} value(s) vanished before the commit, "
                                   f"first {gone[0]}", tier=tier)
            try:
                await self.commit.mark_durable(self.step, tier)
            except IndexUnavailable:  # the commit may have run before the connection failed: keep the parts
                self._marked.add(tier)
                raise
            self._marked.add(tier)  # from here another rank's marker may still complete the tier: keep the parts
            if tier == self._staged_tier:
                self._staged_marked.set()
            await self.commit.wait_complete(self.step, tier)
            self.retention.complete.add(self.step)  # saving this step again is refused from now on
            if staged_here:
                assert self.buffer is not None
                await self.pool.retain(self.buffer, self.step)  # the buffer stays with the tier's checkpoint
        except Superseded as e:  # another rank skipped the tier for this step while this rank wrote it
            handle.durable_at[tier] = time.perf_counter() - handle.started
            handle.set_skipped(tier, e.newer)
            return
        except Exception as e:
            error = await self.commit.fail_tier(self.step, tier, e)
            if staged_here and tier in self._marked and self.buffer is not None:
                # another rank's marker may still complete the tier with these very files: they stay, with the
                # buffer, until retention retires the step
                await self.pool.retain(self.buffer, self.step)
        handle.durable_at[tier] = time.perf_counter() - handle.started
        if error is None:
            await self.retention.apply(tier, finishing=self.step)
            handle.set_done(tier)
        else:
            self._failed[tier] = error  # reported once its parts are removed (_remove_from_failed_tiers)

    async def _remove_from_failed_tiers(self) -> None:
        """A tier where this save failed gets back the room its parts took (a full disk, a capacity, a Redis
        at maxmemory), so the next save can succeed there. Only once every tier is done: until then another
        tier may still read a part back from it."""
        for tier, error in self._failed.items():
            if tier in self._marked:  # this rank committed its share: a slow rank may still complete the tier
                self.handle.set_done(tier, error)
                continue
            keys = [rank_prefix(self.job, self.step, self.plan.rank, self.commit.incarnation)]
            if self.plan.rank == 0:
                keys.append(manifest_key(self.job, self.step, self.commit.incarnation))
            try:
                for key in keys:
                    await self.io.pipelines[tier].attempt(lambda k=key: self.io[tier].delete(k), f"delete {key}")
            except Exception as e:  # the save failed already; say why the space was not given back
                log.warning("step %d failed on tier %s (%s) and its parts could not be removed: %s", self.step,
                            tier, type(error).__name__, e)
            self.handle.set_done(tier, error)

    def _part_key(self, p: int) -> str:
        return PartKey(self.job, self.step, self.plan.rank, p, self.commit.incarnation).path

    async def _write_part(self, tier: str, p: int) -> None:
        ok = False
        try:
            async with self._part_bytes(p) as data:
                await self.io[tier].write(self._part_key(p), data)
            ok = True
            self._holders[p].append(tier)
        finally:
            self._settled(p, ok)

    def _settled(self, p: int, ok: bool) -> None:
        """One tier is done with part p (`ok`: it holds it now). The part is safe once a tier holds it, and
        lost for good once every tier is done and none holds it: either way nobody waits on it any more."""
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
        """The staging buffer is gone: fetch part p from the fastest tier holding it, verified, with that
        tier's timeout and retries. Its bytes are already counted in the writing tier's budget; taking the
        holder's budget as well could deadlock two tiers that read back from each other."""
        assert self._checksums is not None
        expected, reasons = (await self._checksums)[p], []
        for tier in self.io.order(self._holders[p]):
            buf = memoryview(bytearray(length))  # fresh per tier: a timed-out read may still write the last one
            try:
                await self.io.read_verified(PartRead(self._part_key(p), [buf], length, expected,
                                                     algorithm=self.algorithm), [tier], ReadLog(),
                                            budgeted=False)
                return buf
            except IntegrityError as e:
                reasons.append(str(e))
        raise IntegrityError(f"part {self._part_key(p)} is no longer staged and no tier returned it intact "
                             f"({'; '.join(reasons)})")

    # -- giving the staging buffer back ----------------------------------------------------------
    def request_detach(self) -> None:
        """Give the staging buffer back early (the next save needs it). A buffer that is the memory tier's
        files cannot go back: it stays with the checkpoint, and the pool lets the next save take another."""
        if self.buffer is not None and self.buffer.parts is not None:
            return
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
            await self.pool.release(buffer)
