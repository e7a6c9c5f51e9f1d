"""Retention: each tier's rules (keep_last, keep_best, keep_every: lifecycle/rules.py), applied as each save
finishes there, and room made on a full tier.

Only complete checkpoints count, so a save in flight never pushes out the last complete one, and busy
steps (lifecycle/busy.py) are spared and looked at again once they are done. What the index lists decides
first (its metadata ranks the best ones: no manifest is read); then what the tier itself holds of this index's
lineage (lifecycle/lineage.py), so a tier converges to its rules whatever the index forgot (a Redis restarted
empty or restored from an older snapshot, a crash between an unmark and the removal of the data). Removal
itself is lifecycle/removal.py's.

No pass reads the whole history unless it must: each pass judges a window (its keep_last window on, the best ones
by name), and where it left off is kept in the index (lifecycle/retention_note.py), so a new process's first pass
judges the same window; a look at the tier itself lists the steps from that window on. The whole history is
judged, and the whole tier listed, when there is no such note (a first run, an index that lost its notes, rules
changed since), when the index no longer lists a step the last pass kept, or after a pass that failed.
"""
from __future__ import annotations

import asyncio
import bisect
import logging
from typing import Callable, Iterable, Mapping, TypeVar

from ..errors import TieredCkptError
from ..gc_pause import automatic_gc_paused
from ..manifest import Manifest
from ..storage.index import CheckpointStatus, Index, listing_range, read_note, write_note
from ..storage.index.base import NO_STEP
from . import lineage
from .busy import BusySteps
from .removal import Removal
from .retention_note import NOWHERE, Place, note_name
from .rules import Listed, Rules, Verdict

LONG = 512  # checkpoints from which a pass judges them in a thread (`_judged`)
SCAN_EVERY = 16  # a tier itself is listed at its first pass and every 16th (from the window on, but for a whole pass)

T = TypeVar("T")
log = logging.getLogger(__name__)


class Retention:
    def __init__(self, job: str, index: Index, removal: Removal, busy: BusySteps, rules: Mapping[str, Rules]):
        self.job = job
        self.index = index
        self.removal = removal
        self.busy = busy
        self.rules = dict(rules)
        self._lock = asyncio.Lock()
        self._next_pass: dict[str, asyncio.Future[None]] = {}  # per tier: the pass that has not started yet
        self._finishing: dict[str, set[int]] = {}  # per tier: saves waiting for that pass (not busy for it)
        self._deferred: set[str] = set()  # tiers whose last pass spared a busy step it would have removed
        self._passes: dict[str, int] = {}  # per tier: passes so far (when to look at the tier itself)
        self._floor: dict[str, int] = {}  # per tier: the oldest step the next pass judges (see _window)
        self._held: dict[str, set[int]] = {}  # per tier: older steps kept as best, which the next pass asks for
        self._seen: dict[str, set[int]] = {}  # per tier: the steps complete there that the last pass kept
        self._strays: dict[str, int] = {}  # tiers that hold steps the index does not keep there (left by _converge):
        # the oldest of them, from which the next pass lists the tier
        self._recalled: set[str] = set()  # tiers whose note (where an earlier process left off) was read
        self._noted: dict[str, bytes] = {}  # per tier: the note in the index, as this process last read or wrote it
        self._relisted: dict[str, set[int]] = {}  # per tier: steps the writer listed again, below a recalled window

    async def apply(self, tier: str, *, finishing: int | None = None) -> None:
        """Apply the tier's rules as save `finishing` ends. Saves that finish while a pass runs share the
        next pass: in a burst, retention costs one pass per pass, not one per save."""
        rules = self.rules.get(tier)
        if rules is None or not rules.bounded:
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
            rules = self.rules[tier]
            try:
                await self._recall(tier, rules)
                statuses, forgot, first = await self._window(tier, finishing)

                def busy() -> set[int]:  # asked again before each removal: a load may have begun meanwhile
                    return self.busy.steps(finishing_on=tier, finishing=finishing)

                def judge() -> tuple[Verdict, list[CheckpointStatus]]:
                    verdict = rules.judge([(s.step, s.metadata) for s in statuses if tier in s.complete])
                    oldest, kept = verdict.oldest_last, verdict.kept
                    # older than the keep_last window, complete or not, and kept by no rule
                    return verdict, [] if oldest is None else [
                        s for s in statuses if tier in s.tiers and s.step < oldest and s.step not in kept]

                verdict, older = await self._judged(len(statuses), judge)
                spared: set[int] = set()  # older than the keep_last window yet still there after this pass
                dropped: set[int] = set()
                for s in older:
                    await self.busy.no_load_picking()
                    if s.step in busy():
                        self._deferred.add(tier)  # look again once that save or load is done (revisit)
                        spared.add(s.step)
                    else:
                        await self.removal.drop_tier(s, tier)
                        dropped.add(s.step)
                await self._judged(len(statuses), lambda: self._remember(
                    tier, rules, verdict, [s for s in statuses if s.step not in dropped], spared))
                if self._scan_due(tier) or forgot or tier in self._strays:
                    # the tier from the window on (its older steps were judged), or whole after a whole pass
                    since = None if first is None else min(first, self._strays.get(tier, first))
                    left = await self._converge(tier, rules, statuses, busy, first=since)
                    if left is not None:
                        self._strays[tier] = left  # listed again at the next pass, until the tier agrees
                    else:
                        self._strays.pop(tier, None)
                await self._keep_note(tier, rules)
            except (TieredCkptError, OSError) as e:  # a tier or the index failing must never fail a save
                self._floor.pop(tier, None)  # the next pass looks at the whole history again
                log.warning("retention on tier %s did not finish (the next save tries again): %s: %s", tier,
                            type(e).__name__, e)

    async def _judged(self, size: int, work: Callable[[], T]) -> T:
        """`work` on a listing of `size` checkpoints: in a thread (automatic collection paused) when it is long, as
        a first pass's over the whole history is (ten thousand statuses judged and sorted: ~0.1 s), so nothing per
        checkpoint runs on the event loop; inline when it is a window's few."""
        if size < LONG:
            return work()

        def paused() -> T:
            with automatic_gc_paused():
                return work()
        return await self.removal.io.run_blocking(paused)

    async def _window(self, tier: str, finishing: set[int]) -> tuple[list[CheckpointStatus], bool, int | None]:
        """What this pass judges: at the first pass (or after one that failed), every checkpoint the index lists;
        afterwards only those from the oldest step the last pass left to judge again on (its keep_last window,
        what it spared as busy) and the saves finishing now, plus the older ones kept as best (their rank may
        change). What lies below and is not listed here was judged already: removed, or kept by keep_every for
        good. So a pass costs the same at ten thousand checkpoints as at a hundred. Every checkpoint is listed
        again, and True returned (the tier is to be listed now), when the index no longer lists one that the
        last pass kept: it forgot (restarted empty, restored from an older snapshot) or a best one went. Also
        returned: the oldest step of the window (None: every checkpoint was listed)."""
        floor = self._floor.get(tier)
        if floor is None:
            return await self.index.list(self.job), False, None
        held, seen = self._held.get(tier, set()), self._seen.get(tier, set())
        first = min([floor, *finishing])
        also = held | self._relisted.pop(tier, set())
        statuses = await listing_range(self.index, self.job, first, also=sorted(also))
        present = {s.step for s in statuses if tier in s.complete}
        if (held | seen) - present:
            log.info("retention on tier %s: the index no longer lists step(s) %s, which it kept; looking at every "
                     "checkpoint and at the tier", tier, sorted((held | seen) - present)[:10])
            self._floor.pop(tier, None)
            if self.removal.rank == 0:  # the next writer's start compares the whole history with the tiers again
                await write_note(self.index, self.job, lineage.NOTE, lineage.FORGOT)
            return await self.index.list(self.job), True, None
        return statuses, False, first

    async def _recall(self, tier: str, rules: Rules) -> None:
        """At this process's first pass on `tier`: where an earlier process's passes left off (its note in the
        index), if it judged by the same rules; `_window` then checks it against what the index lists."""
        if tier in self._recalled:
            return
        self._recalled.add(tier)
        if self._floor.get(tier) is not None:
            return
        data = await read_note(self.index, self.job, note_name(tier))
        place = Place.from_bytes(data, rules)
        if place is None:
            return
        self._floor[tier], self._held[tier], self._seen[tier] = place.floor, set(place.held), set(place.seen)
        self._noted[tier] = data or b""
        # listed again by this writer's start (the index had forgot them): judged once, by name, as the best are
        self._relisted[tier] = {st for st in self.removal.relisted if st < place.floor}

    async def _keep_note(self, tier: str, rules: Rules) -> None:
        """Keep in the index where this pass left off (rank 0 alone writes it; every rank reads it), once its
        removals are done: a crash before leaves the previous note, whose window covers them. Unchanged: not
        written again."""
        if self.removal.rank != 0:
            return
        floor = self._floor.get(tier)
        if floor is None:
            data = NOWHERE
        else:
            place = Place(min(floor, self._strays.get(tier, floor)), frozenset(self._held.get(tier, ())),
                          frozenset(self._seen.get(tier, ())))
            data = place.to_bytes(rules)
        if self._noted.get(tier, NOWHERE) != data:
            await write_note(self.index, self.job, note_name(tier), data)
            self._noted[tier] = data

    async def _keep_note_after_room(self, tier: str) -> None:
        """`_keep_note` after make_room retired a step: an index that fails here fails nothing (the room is made;
        the next pass writes the note)."""
        if tier in self.rules and self.rules[tier].bounded:
            try:
                await self._keep_note(tier, self.rules[tier])
            except (TieredCkptError, OSError) as e:
                log.warning("retention on tier %s: its note was not kept (the next pass writes it): %s: %s", tier,
                            type(e).__name__, e)

    def _remember(self, tier: str, rules: Rules, verdict: Verdict, statuses: list[CheckpointStatus],
                  spared: set[int]) -> None:
        """Where the next pass starts (`_window`): the keep_last window's oldest step, or the oldest step spared
        as busy; the older steps kept as best, which the next pass asks for by name; and the steps from there on
        that stay complete on the tier (`statuses`: what this pass leaves), which the next pass expects to see."""
        oldest_last = verdict.oldest_last
        if oldest_last is None:  # nothing complete on the tier yet: the next pass looks at everything again
            self._floor.pop(tier, None)
            self._held.pop(tier, None)
            self._seen.pop(tier, None)
            return
        floor = min([oldest_last, *spared])
        self._floor[tier] = floor
        self._seen[tier] = {s.step for s in statuses if tier in s.complete and s.step >= floor}
        self._held[tier] = {st for st in verdict.best if st < floor}
        if rules.keep_best and rules.keep_every:  # keep_every's steps below the floor may rank among the best
            ranked = rules.best.ranked([(s.step, s.metadata) for s in statuses if tier in s.complete
                                        and s.step < floor and s.step in verdict.every]) if rules.best else []
            self._held[tier] |= set(ranked[:rules.keep_best])

    def _scan_due(self, tier: str) -> bool:
        """Whether this pass also lists the tier itself (`_converge`): at the first pass and every SCAN_EVERY
        passes, on every kind of tier. A listing grows with the history the tier keeps (and costs requests on
        S3 or Redis); between them the index's record is what a pass judges by."""
        done = self._passes.get(tier, 0)
        self._passes[tier] = done + 1
        return done % SCAN_EVERY == 0

    async def _converge(self, tier: str, rules: Rules, statuses: list[CheckpointStatus],
                        busy: Callable[[], set[int]], *, first: int | None = None) -> int | None:
        """What the tier holds of this index's lineage beyond what the index lists: steps the index does not
        list (or whose record no longer targets this tier: a removal cut short). Whole ones count beside the
        complete ones the index lists, judged by the same rules (their metadata from their manifests); the rest
        of them older than the keep_last window go. Manifests are read newest first only as far as keep_last
        needs, and beyond that only where keep_best or keep_every could keep the step. With `first`, `statuses` is a
        pass's window (every step from `first` on, and the best ones below it) and only the tier's steps from
        `first` on are looked at: the older ones were judged. Returns the oldest step the tier still holds of
        those afterwards (kept, or spared as busy), or None: the next pass looks at the tier again from there."""
        io = self.removal.io
        # the tier's step folders against the steps the index keeps there: only the others' keys are listed
        kept_here = await self._judged(len(statuses), lambda: {s.step for s in statuses if tier in s.tiers
                                                                and "index" not in s.failed})
        copies = await lineage.copies_beyond(io, tier, self.job, self.index.identity, kept_here, first=first)

        def compare() -> tuple[dict[int, CheckpointStatus], list[int], dict[int, Listed]]:
            by_step = {s.step: s for s in statuses if "index" not in s.failed}
            unlisted = sorted(not_kept_here(copies, by_step, tier, io.names), reverse=True)
            found = {s.step: (s.step, s.metadata) for s in statuses if tier in s.complete} if unlisted else {}
            return by_step, unlisted, found

        by_step, unlisted, found = await self._judged(max(len(statuses), len(copies)), compare)
        if not unlisted:
            return None
        assert rules.keep_last is not None
        ordered = await self._judged(len(found), lambda: sorted(found))  # found's steps: one bisect counts newer ones
        for st in unlisted:  # newest first
            if st in by_step:
                continue
            if len(ordered) - bisect.bisect_right(ordered, st) >= rules.keep_last and not rules.may_keep_old(st):
                continue
            manifest = await self._whole(tier, copies[st])
            if manifest is not None:
                if st not in found:
                    bisect.insort(ordered, st)
                found[st] = (st, manifest.metadata)
        verdict = await self._judged(len(found), lambda: rules.judge(list(found.values())))
        oldest_last = verdict.oldest_last
        left: int | None = None
        for st in unlisted:  # newest first: `left` ends at the oldest left
            if st in verdict.kept or (st not in by_step and (oldest_last is None or st > oldest_last)):
                # kept, or newer than what is kept (not ours to judge: gc's); the keep_last window moves on,
                # so a later pass judges those within it again (keep_every's and the best stay as they are)
                if oldest_last is None or st >= oldest_last:
                    left = st
                continue
            await self.busy.no_load_picking()
            if st in busy():
                self._deferred.add(tier)
                left = st
                continue
            log.info("retention on tier %s: removing step %d, which the index %s", tier, st,
                     "does not list" if st not in by_step else "no longer keeps on this tier")
            await self.removal.remove_from_tier(tier, st)
        return left

    async def _whole(self, tier: str, copies: list[lineage.Copy]) -> Manifest | None:
        """The manifest of a copy of this index that it committed and that is whole on the tier, or None."""
        for copy in copies:
            if not copy.committed:
                continue
            try:
                manifest = await lineage.read_manifest(self.removal.io, tier, copy)
            except TieredCkptError:
                continue
            if manifest.index == self.index.identity and copy.whole(manifest):
                return manifest
        return None

    async def make_room(self, tier: str, *, finishing: int) -> bool:
        """`tier` is full while save `finishing` writes to it: retire one of its checkpoints that no save or load
        is using, however the rules are set, but never the newest complete one (a complete one the index lists,
        or one of the lineage that the index does not list: left by a crash or forgotten). It gives up first what
        no rule keeps, then what only keep_last keeps, then keep_every's, each oldest first, and the best ones
        last, worst first (rules.Verdict.retire_order). Copies the index does not list count as kept by no rule
        (nothing of them is known without reading their manifests, and a crash's leftovers are among them). True
        if one was retired (the caller tries again then). What it judges is what the tier holds: its listing, and
        the index's records of those steps asked for by name, never the job's whole history (a memory tier that
        makes room at every save holds a few checkpoints of the ten thousand an S3 tier keeps)."""
        async with self._lock:
            copies = await lineage.scan(self.removal.io, tier, self.job, self.index.identity)
            statuses = await listing_range(self.index, self.job, NO_STEP, also=sorted(copies))

            def order() -> tuple[dict[int, CheckpointStatus], int | None, list[int]]:
                by_step = {s.step: s for s in statuses if "index" not in s.failed}
                listed = [(s.step, s.metadata) for s in statuses if tier in s.complete]
                newest = max([*(st for st, _ in listed),
                              *[st for st in copies if st not in by_step and st < finishing]], default=None)
                # here also the copies a renamed tier left (not_kept_here spares them): a full tier fails every save
                unlisted = [st for st in copies if st not in by_step or tier not in by_step[st].tiers]
                verdict = self.rules.get(tier, Rules(None)).judge(listed)
                return by_step, newest, verdict.retire_order({*(st for st, _ in listed), *unlisted})

            by_step, newest, retire_order = await self._judged(max(len(statuses), len(copies)), order)
            await self.busy.no_load_picking()
            busy = self.busy.steps() | {finishing}  # asked after the scan: a load may have begun during it
            for st in retire_order:
                if st == newest or st in busy or st > finishing:
                    continue
                log.warning("tier %s is full: retiring step %d early (its retention rules cannot hold there) to make "
                            "room for step %d", tier, st, finishing)
                if st in by_step and tier in by_step[st].tiers:
                    await self.removal.drop_tier(by_step[st], tier)
                else:
                    await self.removal.remove_from_tier(tier, st)
                # this process's own removal: the next pass (and a later process's, by the note) expects it gone
                # from the window (a best one retired still sends the next pass back to every checkpoint: the
                # best below the window are ranked again from there)
                self._seen.get(tier, set()).discard(st)
                await self._keep_note_after_room(tier)
                return True
            return False

    async def revisit(self) -> None:
        """A save finished: apply the rules again on the tiers where a pass spared a step only because it was
        busy, so a burst does not leave a tier above keep_last (or a full memory tier) until the next save."""
        deferred, self._deferred = self._deferred, set()
        for tier in deferred:
            await self.apply(tier)


def not_kept_here(copies: Iterable[int], by_step: Mapping[int, CheckpointStatus], tier: str,
                  configured: Iterable[str]) -> list[int]:
    """Steps of `copies` on `tier` that the index does not keep there: unlisted, or listed without this tier (a
    removal cut short). A record naming a tier this config does not have is left alone: that tier may be this
    one under its earlier name, and its copies here whole checkpoints (the engine warns at open)."""
    known = set(configured)
    return [st for st in copies if st not in by_step or (tier not in by_step[st].tiers and
                                                         set(by_step[st].tiers) <= known)]
