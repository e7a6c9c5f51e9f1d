"""The commit protocol of one rank, over the index.

For each checkpoint a save calls, in order: `begin` (the checkpoint is listed, incomplete), `put_manifest`
(rank 0) and `put_rank_meta` (every rank, its part checksums), then per tier, once this rank's parts and
records are durable on it, `mark_durable`, then `wait_complete` until every rank of this session has
marked the tier (the index makes the last marker the commit, atomically). A failure on a tier is
recorded with `fail_tier`, where every rank's wait sees it, so all ranks raise the same error. Markers are
scoped to the session (one opening of the engines of a job), so markers of a crashed earlier attempt at the
same step never count towards a new one.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import time
from typing import Any, Mapping, Sequence

from ..errors import IndexUnavailable, RankFailed, TieredCkptError, TierTimeout
from ..storage.index import CommitState, Index
from ..storage.index.base import TierState
from ..layout import incarnation_dir

log = logging.getLogger(__name__)


class Superseded(Exception):
    """A tier skipped this save for a newer one (this rank decided, or another rank did)."""

    def __init__(self, newer: int):
        super().__init__(f"skipped: superseded by step {newer}")
        self.newer = newer


class Committer:
    def __init__(self, index: Index, job: str, *, rank: int, world_size: int, session: str, timeout: float,
                 index_timeout: float = 10.0):
        self.index = index
        self.index_timeout = index_timeout  # how long the index may be unreachable before a commit wait fails
        # a poll names this rank where the index takes it (the file index then reads O(1) files); an index of an
        # earlier release or a third party's without the keyword is polled as before
        self.poll_as = {"rank": rank} if "rank" in inspect.signature(index.tier_state).parameters else {}
        self._recording: set[asyncio.Future[None]] = set()  # failures being recorded once the index answers
        self.job = job
        self.rank = rank
        self.world_size = world_size
        self.session = session
        self.timeout = timeout
        # this session's folder on the tiers: no other opening of the job (a zombie included) writes there
        self.incarnation = incarnation_dir(index.identity, session)

    async def begin(self, step: int, tiers: Sequence[str], *, nbytes: int | None = None,
                    metadata: Mapping[str, Any] | None = None) -> None:
        """The checkpoint is listed, incomplete; rank 0 also records its size and metadata for list()."""
        info = {"nbytes": nbytes, "metadata": dict(metadata or {}), "folder": self.incarnation} \
            if self.rank == 0 and nbytes is not None else None
        await self.index.begin(self.job, step, tiers, info)

    async def put_manifest(self, step: int, data: bytes) -> None:
        await self.index.put_manifest(self.job, step, data)

    async def put_rank_meta(self, step: int, data: bytes) -> None:
        await self.index.put_rank_meta(self.job, step, self.rank, data)

    async def mark_durable(self, step: int, tier: str) -> None:
        """This rank's parts and records are durable on `tier`; the last rank's marker commits the tier."""
        await self.index.mark_durable(self.job, step, tier, self.rank, self.world_size, self.session)

    async def wait_complete(self, step: int, tier: str) -> None:
        """Return once every rank has marked `tier` (it is then complete); raise the first rank's recorded
        failure, or a timeout naming the ranks that never reported (a killed rank records nothing). An index that
        does not answer is named as such: IndexUnavailable once it has been unreachable for `index_timeout`, and a
        timeout that the index's slowness ate into says so (the other ranks' markers may be queued behind it)."""
        if self.world_size == 1:
            return
        deadline = time.monotonic() + self.timeout
        delay = 0.005
        unreachable_since: float | None = None
        troubled = 0.0  # how long the index was unreachable or slow during this wait
        slowest = 0.0  # the longest a poll of the index took
        last_poll = False
        while True:
            asked = time.monotonic()
            try:
                state = await self.index.tier_state(self.job, step, tier, self.session, **self.poll_as)
            except IndexUnavailable:
                unreachable_since = unreachable_since or asked
                if time.monotonic() - unreachable_since >= self.index_timeout or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(min(0.25, self.index_timeout / 10))
                continue
            took = time.monotonic() - asked
            if unreachable_since is not None or took > self.index_timeout / 2:
                troubled += time.monotonic() - (unreachable_since or asked)  # named if the wait times out
            unreachable_since = None
            slowest = max(slowest, took)
            if state.state == CommitState.COMPLETE:
                return
            if state.state == CommitState.SKIPPED and state.newer is not None:
                raise Superseded(state.newer)
            if state.state == CommitState.FAILED:
                raise RankFailed(f"step {step}: {state.reason}", tier=tier)
            if state.forgotten:  # begin's record is gone (retention keeps it while a tier still holds the step)
                raise IndexUnavailable(f"index {self.index.identity} no longer has the record of step {step} (the "
                                       f"server restarted empty or was restored from an older snapshot, or the "
                                       f"step was deleted meanwhile): its commit on tier {tier!r} cannot complete; "
                                       f"the next save commits again")
            if time.monotonic() > deadline:
                if not last_poll and slowest > 1.0:  # the answer may be stale: the stall ended just now
                    last_poll = True
                    continue
                missing = sorted(set(range(self.world_size)) - await self._ranks_done(step, tier, state))
                if troubled:
                    raise IndexUnavailable(f"index {self.index.identity} was unreachable or slow for {troubled:.1f}s "
                                           f"while step {step} waited {self.timeout:g}s for its commit on tier "
                                           f"{tier!r}; ranks {missing} were not seen durable (their markers, or "
                                           f"their failures, may have been lost there)")
                slow = (f"; the index {self.index.identity} was slow to answer (one poll took {slowest:.1f}s), so "
                        f"their markers may have been held up there" if slowest > 1.0 else "")
                raise TierTimeout(f"step {step} not complete after {self.timeout}s: "
                                  f"ranks {missing} never reported their parts durable{slow}", tier=tier)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.25)

    async def _ranks_done(self, step: int, tier: str, polled: TierState) -> frozenset[int]:
        """Every rank that marked `tier`, for a timeout's message: a poll may have reported this rank alone
        (the file index's does); one full read, or what the poll said where the index cannot answer."""
        try:
            return (await self.index.tier_state(self.job, step, tier, self.session)).ranks_done | polled.ranks_done
        except TieredCkptError:
            return polled.ranks_done

    async def close(self) -> None:
        """Stop recording failures the index did not take (the engine closes: the index goes with it)."""
        for task in list(self._recording):
            task.cancel()
        if self._recording:
            await asyncio.wait(list(self._recording))

    async def _record_failure_later(self, step: int, tier: str, reason: str) -> None:
        """Record a failure the index did not take (a stalled or restarting server), retrying until
        `commit_timeout`: the other ranks wait for this rank's marker or failure until then, and end at once
        when they see it."""
        deadline = time.monotonic() + self.timeout
        delay = 0.1
        while time.monotonic() < deadline:
            await asyncio.sleep(delay)
            try:
                await self.index.mark_failed(self.job, step, tier, self.rank, self.session, reason)
                return
            except (TieredCkptError, OSError):
                delay = min(delay * 2, 2.0)
        log.error("the failure of tier %s at step %d was never recorded in the index: the other ranks waited "
                  "commit_timeout", tier, step)

    async def skip_tier(self, step: int, tier: str, newer: int) -> None:
        """This rank skips `tier` for `step` (a newer save superseded it there): recorded where every rank's
        wait sees it, so every rank skips the tier for this step too and none waits for a commit."""
        log.info("checkpoint step %d skips tier %s: it cannot keep up, and step %d supersedes it", step, tier, newer)
        try:
            await self.index.mark_skipped(self.job, step, tier, self.rank, self.session, newer)
        except TieredCkptError as e:
            log.warning("could not record that tier %s skipped step %d: %s", tier, step, e)

    async def skipped(self, step: int, tier: str) -> int | None:
        """The newer step for which another rank skipped `tier` for `step`; None if none did."""
        if self.world_size == 1:
            return None
        state = await self.index.tier_state(self.job, step, tier, self.session, **self.poll_as)
        return state.newer if state.state == CommitState.SKIPPED else None

    async def fail_tier(self, step: int, tier: str, error: BaseException) -> BaseException:
        """Record this rank's failure on `tier` where every rank sees it; return the error to raise here."""
        if isinstance(error, RankFailed):  # another rank's failure, already recorded
            return error
        reason = f"{type(error).__name__}: {error}"
        # at INFO: the engine warns once per outage of the tier (save/failures.py), not once per save
        log.info("checkpoint step %d failed on tier %s (rank %d): %s", step, tier, self.rank, reason)
        try:
            await self.index.mark_failed(self.job, step, tier, self.rank, self.session, reason)
        except (TieredCkptError, OSError) as e:  # the index being down must not hide the original error
            log.warning("could not record the failure of tier %s in the index yet (%s); trying again in the "
                        "background, so the other ranks' commit wait ends when the index answers again", tier, e)
            task = asyncio.ensure_future(self._record_failure_later(step, tier, reason))
            self._recording.add(task)
            task.add_done_callback(self._recording.discard)
        if self.world_size == 1:
            return error
        failed = RankFailed(f"step {step}: rank {self.rank}: {reason}", tier=tier)
        failed.__cause__ = error
        return failed
