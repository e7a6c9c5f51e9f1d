"""Retention and deletion: keep_last per tier, removing a checkpoint, cleaning what a crashed run left, and
the one definition of which steps are busy.

A step is *busy* while a save of it is in flight (not yet done on every tier it targets) or a load is
reading it; nothing here removes a busy step. Every removal drops the index record before the data, so a
crash part-way leaves unreferenced bytes on a tier, never a "complete" entry whose parts are gone.
"""
from __future__ import annotations

import asyncio
import logging
from collections import Counter
from contextlib import contextmanager
from typing import Any, Awaitable, Callable, Iterator, Mapping, Protocol

from ..errors import CheckpointExists, IncompleteCheckpoint, IndexUnavailable, TierError, TierNotFound
from ..storage.index import CheckpointStatus, Index
from ..layout import index_dir, manifest_key, parse_key, step_prefix
from ..manifest import Manifest
from ..storage.tier_io import TierIO

log = logging.getLogger(__name__)


class _InFlight(Protocol):
    def done(self) -> bool: ...
    def done_except(self, tier: str) -> bool: ...


class BusySteps:
    """Saves in flight (tracked until their handle is done on every tier) and loads reading a step."""

    def __init__(self) -> None:
        self._saves: dict[int, _InFlight] = {}
        self._loads: Counter[int] = Counter()

    def saving(self, step: int, handle: _InFlight) -> None:
        self._saves[step] = handle

    def saved(self, step: int) -> None:
        self._saves.pop(step, None)

    @contextmanager
    def loading(self, step: int) -> Iterator[None]:
        self._loads[step] += 1
        try:
            yield
        finally:
            self._loads[step] -= 1
            if not self._loads[step]:
                del self._loads[step]

    def steps(self, *, finishing_on: str | None = None, finishing: set[int] = frozenset()) -> set[int]:  # type: ignore[assignment]
        """Busy steps. A save in `finishing` whose only unfinished tier is `finishing_on` (it is running the
        retention pass of that tier) does not count: nothing else of it still reads or writes."""
        busy = {s for s, h in self._saves.items()
                if not h.done() and not (s in finishing and h.done_except(finishing_on))}  # type: ignore[arg-type]
        return busy | set(self._loads)


class Retention:
    def __init__(self, job: str, index: Index, tiers: TierIO, keep_last: Mapping[str, int | None], *, rank: int = 0,
                 world_size: int = 1, reclaim: Callable[[str, int], Awaitable[None]] | None = None):
        self.job = job
        self.index = index
        self.tiers = tiers
        self.keep_last = dict(keep_last)
        self.rank = rank
        self.world_size = world_size
        self.busy = BusySteps()
        self.reclaim = reclaim  # a step leaves a tier: the staging pool takes back the files it staged there
        self.complete: set[int] = set()  # steps complete on some tier, as far as this process knows
        self._lock = asyncio.Lock()
        self._next_pass: dict[str, asyncio.Future[None]] = {}  # per tier: the pass that has not started yet
        self._finishing: dict[str, set[int]] = {}  # per tier: saves waiting for that pass (not busy for it)
        self._deferred: set[str] = set()  # tiers whose last pass spared a busy step it would have removed

    async def clear_crashed_attempt(self, step: int) -> None:
        """Before saving `step` (single rank): remove what a crashed earlier attempt at it left. With several
        ranks, session-scoped markers keep such leftovers from counting, and a resuming load removes them."""
        if self.world_size > 1:
            return
        for status in await self.index.list(self.job):
            if status.step == step:
                if status.is_complete:
                    raise CheckpointExists(f"job {self.job!r} step {step} became complete elsewhere meanwhile")
                await self.forget(status)

    async def apply(self, tier: str, *, finishing: int | None = None) -> None:
        """Apply keep_last on `tier` as save `finishing` ends. Only complete checkpoints count, so a save in
        flight never pushes out the last complete one; other busy steps are untouched. Saves that finish while
        a pass runs share the next pass: in a burst, retention costs one pass per pass, not one per save."""
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
                            await self.drop(s, tier)
            except Exception as e:  # retention must never fail a save
                log.error("retention on tier %s failed: %s: %s", tier, type(e).__name__, e)

    async def revisit(self) -> None:
        """A save finished: apply keep_last again on the tiers where a pass spared a step only because it was
        busy, so a burst does not leave a tier above keep_last (or a full memory tier) until the next save."""
        deferred, self._deferred = self._deferred, set()
        for tier in deferred:
            await self.apply(tier)

    async def delete(self, step: int) -> None:
        """Delete checkpoint `step` everywhere; refused while it is busy."""
        if step in self.busy.steps():
            raise CheckpointExists(f"job {self.job!r} step {step} is being saved or loaded; try again later")
        for status in await self.index.list(self.job):
            if status.step == step:
                await self.forget(status)
                return
        raise IncompleteCheckpoint(f"job {self.job!r} has no checkpoint {step}")

    async def drop_incomplete_after(self, step: int) -> None:
        """When resuming from `step`: remove incomplete checkpoints newer than it, leftovers of the crashed
        run that the resumed run would otherwise save over."""
        try:
            statuses = await self.index.list(self.job)
        except IndexUnavailable as e:
            log.warning("%s: leftovers of the crashed run are not cleaned up now", e)
            return
        busy = self.busy.steps()
        for s in statuses:
            if s.step > step and not s.is_complete and s.step not in busy:
                log.info("removing incomplete checkpoint %d left by an earlier run", s.step)
                await self.forget(s)

    async def forget(self, status: CheckpointStatus) -> None:
        """Remove a checkpoint everywhere: a tombstone, then the index record, then the data on every tier,
        then the tombstone. A crash at any point leaves the tombstone, so the checkpoint can neither come back
        from the tiers' manifests nor keep its data: the next writer finishes the job (finish_burials)."""
        await self.index.bury(self.job, status.step)
        await self.index.delete(self.job, status.step)
        self.complete.discard(status.step)
        await self._remove_data(status.step, [n for n in status.tiers if n in self.tiers])
        await self.index.unbury(self.job, status.step)

    async def finish_burials(self) -> None:
        """A writer starting: remove the data of checkpoints whose removal a crash cut short."""
        for step in sorted(await self.index.buried(self.job)):
            log.info("finishing the removal of checkpoint %d, cut short earlier", step)
            await self.index.delete(self.job, step)
            await self._remove_data(step, list(self.tiers))
            await self.index.unbury(self.job, step)

    async def _remove_data(self, step: int, tiers: list[str]) -> None:
        for name in tiers:
            await self._remove_from_tier(name, step)

    async def _remove_from_tier(self, tier: str, step: int) -> None:
        """Every folder this index's incarnations wrote for `step`, and its folder-less keys of formats 1 and
        2 unless their manifest names another index. Nothing else under the step folder: another index's
        folders (an unrelated run sharing the tier's path and job name), a write in progress that a listing
        does not show. (File tiers remove a folder left empty.)"""
        if self.reclaim is not None:
            await self.reclaim(tier, step)
        driver = self.tiers[tier]
        prefix, mine = step_prefix(self.job, step), index_dir(self.index.identity)
        parsed = [(k, parse_key(k)) for k in await driver.list(prefix)]
        await driver.delete(f"{prefix}{mine}/")
        legacy = [k for k, p in parsed if p is not None and not p.incarnation]
        ours = any(p is not None and p.incarnation.startswith(mine + "/") for _, p in parsed)
        # without a folder of this index, the step this index lists is the folder-less one
        if legacy and (not ours or await self._legacy_is_mine(driver, step)):
            for key in legacy:
                await driver.delete(key)

    async def _legacy_is_mine(self, driver: Any, step: int) -> bool:
        """Folder-less (format 1-2) keys beside this index's folder: this index's only if their manifest says so."""
        try:
            manifest = Manifest.from_bytes(await driver.read(manifest_key(self.job, step)))
        except TierNotFound:
            return True  # no manifest (a crashed save of an earlier release): nothing says it is another's
        except TierError:
            return False
        return manifest.index in ("", self.index.identity)

    async def drop(self, status: CheckpointStatus, tier: str) -> None:
        """Remove `status.step` from one tier: the index record first (rank 0 keeps the books), then the
        data (every rank, so node-local tiers are cleaned on every node; on shared tiers it is idempotent)."""
        last = not set(status.tiers) - {tier}  # the step's last tier: the checkpoint goes away entirely
        if self.rank == 0:
            if last:
                await self.index.bury(self.job, status.step)
            await self.index.unmark(self.job, status.step, tier)
        if tier in self.tiers:
            await self._remove_from_tier(tier, status.step)
        if not status.complete - {tier}:
            self.complete.discard(status.step)
        if self.rank == 0 and last:
            await self.index.delete(self.job, status.step)
            await self.index.unbury(self.job, status.step)
