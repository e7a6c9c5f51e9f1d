"""Retention: keep_last per tier, applied as each save finishes there.

Only complete checkpoints count, so a save in flight never pushes out the last complete one, and busy
steps (lifecycle/busy.py) are spared and looked at again once they are done. Removal itself is
lifecycle/removal.py's.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Mapping

from ..errors import TieredCkptError
from ..storage.index import Index
from .busy import BusySteps
from .removal import Removal

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
                complete = sorted(s.step for s in statuses if tier in s.complete)
                if not complete:
                    return
                oldest_kept = complete[-keep_last:][0]
                busy = self.busy.steps(finishing_on=tier, finishing=finishing)
                for s in statuses:
                    if tier in s.tiers and s.step < oldest_kept:
                        if s.step in busy:
                            self._deferred.add(tier)  # look again once that save or load is done (revisit)
                        else:
                            await self.removal.drop_tier(s, tier)
            except (TieredCkptError, OSError) as e:  # a tier or the index failing must never fail a save
                log.warning("retention on tier %s did not finish (the next save tries again): %s: %s", tier,
                            type(e).__name__, e)

    async def revisit(self) -> None:
        """A save finished: apply keep_last again on the tiers where a pass spared a step only because it was
        busy, so a burst does not leave a tier above keep_last (or a full memory tier) until the next save."""
        deferred, self._deferred = self._deferred, set()
        for tier in deferred:
            await self.apply(tier)
