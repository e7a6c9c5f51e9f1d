"""One save in flight: stage the tensors, then persist the parts to every targeted tier at once.

`SaveJob` only orders the steps; each has its home: the copy (copy.py), the records and checksums
(records.py), where a tier reads a part from and when the staging buffer goes back (source.py), and the
protocol on one tier, commit included (tier_write.py).
"""
from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping

from ..errors import (IntegrityError, TieredCkptError, TierError, TierFull, TierNotFound, TierTimeout,
                      TierUnavailable)
from ..lifecycle import fault_points
from ..lifecycle.removal import Removal
from ..lifecycle.retention import Retention
from ..release import release_off_loop
from ..state import FlatState
from ..storage.tier_io import TierIO
from .commit import Committer
from .copy import stage
from .drain import DrainOrder, Drainer, TierOutcome
from .early import EarlyCopies, Launch
from .handle import SaveHandle
from .plan import Plan
from .pool import StagingPool
from .staging_buffer import StagingBuffer
from .records import Records
from .source import PartSource
from .tier_write import TierWrite

# Checksum parts while later ones are still being copied, when the machine has cores to spare. With two
# cores the hashing threads compete with the copy for the only other core and for memory bandwidth (measured:
# save() blocking +15%, durable on the memory tier -15%), so there the parts are hashed after the copy.
HASH_WHILE_STAGING = (os.cpu_count() or 1) > 2
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveServices:
    """What a save job uses of the engine, and nothing more."""

    io: TierIO
    commit: Committer
    retention: Retention
    removal: Removal
    pool: StagingPool
    committed: set[int]  # steps complete somewhere, as far as this process knows (a save adds its own)
    is_saved: Callable[[int], Awaitable[bool]]  # a step complete somewhere (job_store.py): saving it is refused
    checksum: str = "crc32c"  # the parts' checksum algorithm for new checkpoints (checksum.resolve)
    lost: set[int] = field(default_factory=set)  # checkpoints a load found lost: the next save removes them
    # [engine] agent = "on": who drains the slower tiers once the memory tier committed (agent/client.py)
    drainer: Drainer | None = None


class SaveJob:
    def __init__(self, services: SaveServices, step: int, flat: FlatState, plan: Plan, buffer: StagingBuffer,
                 handle: SaveHandle, tiers: list[str], metadata: dict[str, Any], events: Mapping[Any, Any],
                 launch: Launch | None = None, early: EarlyCopies | None = None):
        self.services = services
        self.step = step
        self.flat = flat
        self.plan = plan
        self.handle = handle
        self.tiers = tiers
        self.events = events  # CUDA: the producer streams' state at save() time (copy.producer_events)
        self.launch = launch  # copies launched into `buffer` during the walk (early.py)
        self.early = early
        io, commit = services.io, services.commit
        self.records = Records(io, commit, step, plan, flat.skeleton, metadata, services.checksum)
        self.source = PartSource(io, services.pool, buffer, self.records, tiers)
        self.writes = {t: TierWrite(t, io, commit, services.retention, services.committed, self.source, self.records,
                                    handle) for t in tiers}
        self.task: asyncio.Task[None] | None = None
        first = self.source.files_tier
        # tiers the agent drains: all but the memory tier whose files the staging buffer is, handed over once this
        # rank's parts and records are on that tier, before its commit (the agent drains once the commit is in the
        # index); none without an agent or such a memory tier
        self.handed = [t for t in tiers if t != first] if first is not None and services.drainer is not None else []
        self._handoff: asyncio.Task[None] | None = None
        self._accepted = asyncio.Event()
        if self.handed:
            assert first is not None
            self.writes[first].before_commit = self._hand_off

    def start(self) -> None:
        """Stage (in a thread) and persist in the background; `handle.staged()` resolves after the copy."""
        staging = asyncio.create_task(self._stage())
        self.task = asyncio.create_task(self._run(staging))

    def request_detach(self) -> None:
        self.source.request_detach()

    async def _stage(self) -> None:
        buffer = self.source.buffer
        assert buffer is not None
        hash_staged = (lambda up_to: self.records.hash_staged(buffer.view, up_to)) if HASH_WHILE_STAGING else None
        try:
            await self.services.io.run_copy(stage, self.plan, self.flat.tensors, buffer, self.events, hash_staged,
                                            self.services.pool.gatherer, self.launch, self.early)
        except BaseException as e:
            self.handle.set_staged(e)
            if self.launch is not None:  # its copies land before the buffer can go back to the pool
                try:
                    await asyncio.to_thread(self.launch.synchronize)
                except Exception:  # a broken device: the error being raised says more
                    pass
            raise
        finally:
            self.launch = None
        self.handle.set_staged()
        if buffer.files is not None:
            self.services.pool.prepare_next(buffer.files.nbytes, self.plan)
        # drop references to the caller's tensors, and the paths (new strings at each walk: 1M of them freed on the
        # loop would stall it), in a thread a batch at a time
        held, self.flat.tensors, self.flat.paths = [self.flat.tensors, self.flat.paths], [], []
        await release_off_loop(held)

    async def _run(self, staging: asyncio.Task[None]) -> None:
        commit, handle = self.services.commit, self.handle
        try:
            try:
                await staging
            except asyncio.CancelledError:
                raise
            except BaseException as e:
                for tier in self.tiers:
                    handle.set_done(tier, await commit.fail_tier(self.step, tier, e))
                return
            fault_points.reached("staged", self.step)
            assert self.source.buffer is not None
            self.records.start_checksums(self.source.buffer.view)
            try:
                await self.services.removal.clear_crashed_attempt(self.step)
                await commit.begin(self.step, self.tiers, nbytes=self.plan.total_nbytes,
                                   metadata=self.records.metadata)
            except Exception as e:  # the index is down, or refused: every tier fails, naming it
                # recorded (once the index answers, in the background) where the other ranks' commit waits see it:
                # those whose begin went through would wait for this rank's markers until commit_timeout
                failed = await asyncio.gather(*(commit.fail_tier(self.step, t, e) for t in self.tiers))
                for tier, error in zip(self.tiers, failed):
                    handle.set_done(tier, error)
                return
            if self.handed:
                await self._persist(self.tiers[self.tiers.index(self.source.files_tier)])
                if self._handoff is not None:
                    await self._handoff
                else:  # the memory tier did not commit: the trainer writes the rest from its buffer
                    await asyncio.gather(*(self.writes[t].run() for t in self.handed))
            else:
                await asyncio.gather(*(self._persist(t) for t in self.tiers))
            for write in self.writes.values():
                await write.remove_failed()
            await self.source.finish()
            await self.services.retention.revisit()
        except asyncio.CancelledError:
            handle.cancel()  # nobody waits forever on a save that will never finish
            raise
        except Exception as e:  # a bug or an error no step expected: every tier still pending fails with it
            log.error("step %d: the save stopped on an unexpected error: %s: %s", self.step, type(e).__name__, e)
            handle.set_staged(e)
            for tier in self.tiers:
                handle.set_done(tier, e)
        finally:
            await self.source.release()

    async def _persist(self, tier: str) -> None:
        """With the staging buffer being the memory tier's files, the other tiers start once this rank has
        marked the memory tier durable (tens of ms): else its index writes (fsync on a file index) queue
        behind their writeback on the same file system, and the memory tier commits 3-5x later."""
        first = self.source.files_tier
        if first is not None and tier != first:
            await self.writes[first].settled.wait()
        await self.writes[tier].run()

    # -- the agent (save/drain.py) ---------------------------------------------------------------------------
    async def _hand_off(self) -> None:
        """This rank's copy is on the memory tier, not yet committed: hand the slower tiers to the agent, and wait
        until it accepted them (or refused: the trainer then writes them); their outcomes come back in the
        background. The agent drains once the index says the memory tier committed, and abandons the order if it
        never does (this trainer then writes them from its buffer, as when the memory tier fails unhanded)."""
        self._handoff = asyncio.create_task(self._drain_elsewhere())
        await self._accepted.wait()

    async def _drain_elsewhere(self) -> None:
        assert self.services.drainer is not None
        pending, full = list(self.handed), []
        try:
            try:
                drain = await self.services.drainer.hand_off(await self._order())
            finally:
                self._accepted.set()
            fault_points.reached("handed-off", self.step)
            async for outcome in drain.outcomes():
                if outcome.state == "full":  # this trainer's retention makes room there: written below
                    full.append(outcome.tier)
                if outcome.state in ("abandoned", "full"):  # (abandoned: the memory tier did not commit)
                    continue
                pending.remove(outcome.tier)
                await self._settle(outcome)
        except TieredCkptError as e:
            log.warning("step %d: %s; the trainer writes tier(s) %s itself", self.step, e, ", ".join(pending))
        if pending:  # as a save without an agent: the other tiers start once the memory tier is marked (or done)
            first = self.source.files_tier
            assert first is not None
            await self.writes[first].settled.wait()
        for tier in {*full, *pending}:  # the agent wrote (and retired) there since this process counted its bytes
            file_tier = self.services.io.file_tier(tier)
            if file_tier is not None:
                await file_tier.recount()
        await asyncio.gather(*(self.writes[t].run() for t in pending))

    async def _order(self) -> DrainOrder:
        commit, records, source = self.services.commit, self.records, self.source
        copy = self.writes[self.handed[0]].rank_copy()
        assert source.files_tier is not None
        return DrainOrder(commit.job, self.step, self.plan.rank,
                          commit.world_size, commit.session, commit.incarnation, commit.index.epoch,
                          tuple(self.handed), source.files_tier, copy.keys, copy.lengths,
                          tuple(await records.part_sums()), records.algorithm, records.chunk_size,
                          tuple(await records.blobs()))

    async def _settle(self, outcome: TierOutcome) -> None:
        """A tier the agent drained settled: the handle learns it, and retention runs here, as after a write."""
        tier, handle = outcome.tier, self.handle
        self.source.settled_all(tier, ok=outcome.state == "done")
        handle.settled(tier)
        if outcome.state == "skipped":
            handle.set_skipped(tier, outcome.newer if outcome.newer is not None else self.step)
        elif outcome.state == "done":
            self.services.committed.add(self.step)
            await self.services.retention.apply(tier, finishing=self.step)
            handle.set_done(tier)
        else:
            handle.set_done(tier, outcome_error(outcome, self.step))


TIER_ERRORS = {c.__name__: c for c in (IntegrityError, TierFull, TierNotFound, TierTimeout, TierUnavailable)}


def outcome_error(outcome: TierOutcome, step: int) -> TierError:
    """The error of a tier the agent failed, of the class the agent met where it is a TierError (TierFull,
    TierNotFound, IntegrityError...), so that a caller's `except`/isinstance works as with the trainer's own drain."""
    cls = TIER_ERRORS.get(outcome.kind, TierError)
    return cls(f"step {step}, drained by the agent: {outcome.error}", tier=outcome.tier)
