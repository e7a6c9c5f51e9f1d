"""Retention: keep_last per tier, applied as each save finishes there, and room made on a full tier.

Only complete checkpoints count, so a save in flight never pushes out the last complete one, and busy
steps (lifecycle/busy.py) are spared and looked at again once they are done. What the index lists decides
first; then what the tier itself holds of this index's lineage (lifecycle/lineage.py), so a tier converges
to keep_last whatever the index forgot (a Redis restarted empty or restored from an older snapshot, a crash
between an unmark and the removal of the data). Removal itself is lifecycle/removal.py's.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Mapping

from ..errors import TieredCkptError
from ..storage.index import CheckpointStatus, Index
from . import lineage
from .busy import BusySteps
from .removal import Removal

SCAN_EVERY = 16  # a tier whose listing costs requests (not files of this machine) is looked at every 16th pass

log = logging.getLogger(__name__)


class Retention:
    def __init__(self, job: str, index: Index, removal: Removal, busy: BusySteps,
                 keep_last: Mapping[str, int | None]):
        self.job = job
        self.index = index
        self.removal = removal
        self.busy = busy
        self.keep_last = dict(keep_last)
        self._lock = asyncio.Lock()
        self._next_pass: dict[str, asyncio.Future[None]] = {}  # per tier: the pass that has not started yet
        self._finishing: dict[str, set[int]] = {}  # per tier: saves waiting for that pass (not busy for it)
        self._deferred: set[str] = set()  # tiers whose last pass spared a busy step it would have removed
        self._passes: dict[str, int] = {}  # per tier: passes so far (when to look at the tier itself)

    async def apply(self, tier: str, *, finishing: int | None = None) -> None:
        """Apply keep_last on `tier` as save `finishing` ends. Saves that finish while a pass runs share the
        next pass: in a burst, retention costs one pass per pass, not one per save."""
        if self.keep_last.get(tier) is None:
            return
        if finishing is not None:
            self._finishing.setdefault(tier, set()).add(finishing)
        next_pass = self._next_pass.get(tier)
        if next_pass is None:
            next_pass = self._next_pass[tier] = asyncio.ensure_future(self._pass(tier))
        await asyncio.shield(next_pass)

    async def _pass(self, tier: str) -> None:
        async with self._lock:
            self._next_pass.pop(tier, None)  # from here, a save that finishes waits for the pass after this one
            finishing = self._finishing.pop(tier, set())
            keep_last = self.keep_last[tier]
            assert keep_last is not None
            try:
                statuses = await self.index.list(self.job)
                busy = self.busy.steps(finishing_on=tier, finishing=finishing)
                complete = sorted(s.step for s in statuses if tier in s.complete)
                if complete:
                    oldest_kept = complete[-keep_last:][0]
                    for s in statuses:
                        if tier in s.tiers and s.step < oldest_kept:
                            if s.step in busy:
                                self._deferred.add(tier)  # look again once that save or load is done (revisit)
                            else:
                                await self.removal.drop_tier(s, tier)
                if self._scan_due(tier):
                    await self._converge(tier, keep_last, statuses, busy)
            except (TieredCkptError, OSError) as e:  # a tier or the index failing must never fail a save
                log.warning("retention on tier %s did not finish (the next save tries again): %s: %s", tier,
                            type(e).__name__, e)

    def _scan_due(self, tier: str) -> bool:
        """A tier of files on this machine is listed at every pass (cheap); another at the first pass and every
        SCAN_EVERY passes (a listing of S3 or Redis costs requests)."""
        done = self._passes.get(tier, 0)
        self._passes[tier] = done + 1
        return self.removal.io.file_tier(tier) is not None or done % SCAN_EVERY == 0

    async def _converge(self, tier: str, keep_last: int, statuses: list[CheckpointStatus], busy: set[int]) -> None:
        """What the tier holds of this index's lineage beyond what the index lists: steps the index does not
        list (or whose record no longer targets this tier: a removal cut short). Whole ones count towards
        keep_last beside the complete ones the index lists; the rest of them older than the oldest kept go."""
        io, by_step = self.removal.io, {s.step: s for s in statuses if "index" not in s.failed}
        copies = await lineage.scan(io, tier, self.job, self.index.identity)
        unlisted = sorted((st for st in copies if st not in by_step or tier not in by_step[st].tiers), reverse=True)
        if not unlisted:
            return
        kept = [s.step for s in statuses if tier in s.complete]
        for st in unlisted:  # newest first: only as many manifests are read as keep_last needs
            if len([k for k in kept if k > st]) >= keep_last:
                break
            if st not in by_step and await self._whole(tier, copies[st]):
                kept.append(st)
        keep = sorted(kept)[-keep_last:]
        for st in unlisted:
            if st in keep or (st not in by_step and (not keep or st > keep[0])):
                continue  # kept, or newer than what is kept (not ours to judge: gc's)
            if st in busy:
                self._deferred.add(tier)
                continue
            log.info("retention on tier %s: removing step %d, which the index %s", tier, st,
                     "does not list" if st not in by_step else "no longer keeps on this tier")
            await self.removal.remove_from_tier(tier, st)

    async def _whole(self, tier: str, copies: list[lineage.Copy]) -> bool:
        """A copy of this index that it committed and that is whole on the tier."""
        for copy in copies:
            if not copy.committed:
                continue
            try:
                manifest = await lineage.read_manifest(self.removal.io, tier, copy)
            except TieredCkptError:
                continue
            if manifest.index == self.index.identity and copy.whole(manifest):
                return True
        return False

    async def make_room(self, tier: str, *, finishing: int) -> bool:
        """`tier` is full while save `finishing` writes to it: retire its oldest checkpoint that no save or load
        is using, however keep_last is set, but never the newest complete one: a complete one the index lists,
        or one of the lineage that the index does not list (left by a crash or forgotten). True if one was
        retired (the caller tries again then)."""
        async with self._lock:
            statuses = await self.index.list(self.job)
            by_step = {s.step: s for s in statuses if "index" not in s.failed}
            busy = self.busy.steps() | {finishing}
            copies = await lineage.scan(self.removal.io, tier, self.job, self.index.identity)
            listed = sorted(s.step for s in statuses if tier in s.complete)
            newest = max([*listed, *[st for st in copies if st not in by_step and st < finishing]], default=None)
            candidates = sorted({*listed, *(st for st in copies if st not in by_step or tier not in by_step[st].tiers)})
            for st in candidates:
                if st == newest or st in busy or st > finishing:
                    continue
                log.warning("tier %s is full: retiring step %d early (keep_last cannot hold there) to make room for "
                            "step %d", tier, st, finishing)
                if st in by_step and tier in by_step[st].tiers:
                    await self.removal.drop_tier(by_step[st], tier)
                else:
                    await self.removal.remove_from_tier(tier, st)
                return True
            return False

    async def revisit(self) -> None:
        """A save finished: apply keep_last again on the tiers where a pass spared a step only because it was
        busy, so a burst does not leave a tier above keep_last (or a full memory tier) until the next save."""
        deferred, self._deferred = self._deferred, set()
        for tier in deferred:
            await self.apply(tier)
