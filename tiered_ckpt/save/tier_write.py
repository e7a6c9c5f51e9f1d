"""One save on one tier: its turn, its parts, its records, the check that nothing vanished, the commit, then
retention. A failure is recorded where every rank sees it; the parts of a failed tier are removed once every
tier of the save is done (`remove_failed`), so the room they took is given back.

Order on a tier: wait for the save's turn (`TierIO.turns`: one save writes, one waits; a newer save
supersedes the waiting one, which then skips the tier, recorded so that every rank skips it), write every
part (on the memory tier whose files the staging buffer is, a rename of each file instead), this rank's
checksum record and (rank 0) the manifest, pass the turn on, check that nothing written vanished, mark the
tier durable for this rank, and wait until every rank has (the last marker commits the tier).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from ..errors import IndexUnavailable, TierError, TierFull
from ..layout import committed_key, manifest_key, rank_prefix
from ..lifecycle.copy_commit import CopyThenCommit, RankCopy
from ..lifecycle.retention import Retention
from ..storage.tier_io import TierIO
from .commit import Committer, Superseded
from .handle import SaveHandle
from .records import Records
from .source import PartSource

log = logging.getLogger(__name__)


class TierWrite:
    def __init__(self, tier: str, io: TierIO, commit: Committer, retention: Retention, committed: set[int],
                 source: PartSource, records: Records, handle: SaveHandle):
        self.tier = tier
        self.io = io
        self.commit = commit
        self.retention = retention
        self.committed = committed
        self.source = source
        self.records = records
        self.handle = handle
        self.step = handle.step
        self.marked = False  # this rank marked its parts durable: another rank's marker may complete the tier
        self.settled = asyncio.Event()  # marked durable, or done with the tier whatever happened
        self.error: BaseException | None = None  # this save's error on the tier, reported by remove_failed
        # called once this rank's parts and records are on the tier, before its durable marker (the memory tier's:
        # the save is handed to the agent then, so that no moment after the memory tier's commit finds the slower
        # tiers in nobody's hands: a trainer killed right after that commit still gets them)
        self.before_commit: Callable[[], Awaitable[None]] | None = None

    async def run(self) -> None:
        """Take the turn, then write; skip the tier when a newer save superseded this one there."""
        try:
            await self._run()
        finally:
            self.settled.set()

    async def _run(self) -> None:
        if self.tier == self.source.files_tier:
            # the parts are already this tier's files: a save never falls behind here (committing is a rename),
            # and skipping would throw away a copy that is done
            await self._write(lambda: None)
            return
        turns = self.io.turns(self.tier)
        newer = await turns.take(self.step)
        if newer is not None:
            await self.commit.skip_tier(self.step, self.tier, newer)
            self._skip(newer)
            return
        give_turn = turns.give_once()

        try:
            try:
                newer = await self.commit.skipped(self.step, self.tier)
            except IndexUnavailable:  # write, and let the commit name the problem
                newer = None
            if newer is not None:
                self._skip(newer)
                return
            await self._write(give_turn)
        finally:
            give_turn()

    def _skip(self, newer: int) -> None:
        self.source.settled_all(self.tier, ok=False)
        self.handle.settled(self.tier)
        self.handle.set_skipped(self.tier, newer)

    def rank_copy(self) -> RankCopy:
        """This rank's copy onto this tier, as data (lifecycle/copy_commit.py)."""
        plan, source = self.source.plan, self.source
        return RankCopy(self.tier, self.step, plan.rank, tuple(source.key(p) for p in range(plan.num_parts)),
                        tuple(b - a for a, b in map(plan.part_range, range(plan.num_parts))))

    async def _write(self, give_turn: Callable[[], None]) -> None:
        tier, source = self.tier, self.source
        in_place = tier == source.files_tier  # the staging buffer is this tier's own files
        copy = CopyThenCommit(self.io, self.rank_copy(), source, self.records.blobs, self._commit,
                              make_room=lambda: self.retention.make_room(tier, finishing=self.step),
                              settled=lambda p, ok: source.settled(p, tier, ok), after_records=give_turn)
        try:
            if in_place:
                await self._publish_staged()
            await copy.run(parts_present=in_place)
            if in_place:
                await source.retain()  # the buffer stays with the tier's checkpoint
        except Superseded as e:  # another rank skipped the tier for this step while this rank wrote it
            self.handle.settled(tier)
            self.handle.set_skipped(tier, e.newer)
            return
        except Exception as e:  # recorded for every rank, and reported by the handle
            self.error = await self.commit.fail_tier(self.step, tier, e)
            if in_place and self.marked:
                # another rank's marker may still complete the tier with these very files: they stay, with the
                # buffer, until retention retires the step
                await source.retain()
        self.handle.settled(tier)
        if self.error is None:
            await self.retention.apply(tier, finishing=self.step)
            self.handle.set_done(tier)

    async def _commit(self) -> None:
        """The save's commit on this tier: this rank's durable marker, the wait for every rank's (the last marker
        commits), then the committed marker beside the copy."""
        if self.before_commit is not None:
            await self.before_commit()
        try:
            await self.commit.mark_durable(self.step, self.tier)
        except IndexUnavailable:  # the commit may have run before the connection failed: keep the parts
            self.marked = True
            raise
        self.marked = True
        self.settled.set()
        await self.commit.wait_complete(self.step, self.tier)
        self.committed.add(self.step)  # saving this step again is refused from now on
        await self._mark_committed_on_tier()

    async def _mark_committed_on_tier(self) -> None:
        """Rank 0 leaves a marker beside the copy: the tier then knows by itself that this copy was committed,
        should the index forget it (restarted empty, restored from an older snapshot). A zombie's copy, which
        the index refused, never has one. Best effort: without it the copy is only invisible to such recovery."""
        if self.source.plan.rank != 0:
            return
        key = committed_key(self.commit.job, self.step, self.commit.incarnation)
        try:
            await self.io.write(self.tier, key, memoryview(b""))
        except TierError as e:
            log.warning("step %d is committed on tier %s, but its marker there was not written: %s", self.step,
                        self.tier, e)

    async def _publish_staged(self) -> None:
        """The parts are already this tier's files: a rename each puts them under their keys. Past the tier's
        capacity, its older checkpoints may be retirable now: retention runs once, then the rename again."""
        arena, source = self.source.pool.arena, self.source
        assert arena is not None and source.buffer is not None
        keys = [source.key(p) for p in range(source.plan.num_parts)]
        try:
            try:
                await self.io.run_blocking(arena.publish, source.buffer, keys)
            except TierFull:
                await self.retention.apply(self.tier, finishing=self.step)
                while True:
                    try:
                        await self.io.run_blocking(arena.publish, source.buffer, keys)
                        break
                    except TierFull:
                        if not await self.retention.make_room(self.tier, finishing=self.step):
                            raise
        except TierError:
            raise
        except OSError as e:
            raise TierError(f"publishing the staged parts of step {self.step}: {e}", tier=self.tier) from e
        source.settled_all(self.tier, ok=True)

    async def remove_failed(self) -> None:
        """Report this tier's error, after giving back the room its parts took (a full disk, a capacity, a Redis
        at maxmemory), so the next save can succeed there; unless this rank committed its share, since a slow
        rank may still complete the tier. Called once every tier of the save is done: until then another tier
        may still read a part back from this one."""
        if self.error is None:
            return
        if not self.marked:
            job, rank, incarnation = self.commit.job, self.source.plan.rank, self.commit.incarnation
            keys = [rank_prefix(job, self.step, rank, incarnation)]
            if rank == 0:
                keys.append(manifest_key(job, self.step, incarnation))
            try:
                for key in keys:
                    await self.io.delete(self.tier, key)
            except TierError as e:  # the save failed already; say why the space was not given back
                log.warning("step %d failed on tier %s (%s) and its parts could not be removed: %s", self.step,
                            self.tier, type(self.error).__name__, e)
        self.handle.set_done(self.tier, self.error)
