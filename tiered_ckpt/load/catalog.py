"""What checkpoints a job has and what they hold: from the index, or from the tiers when the index can't say.

The index is the authority. When it is unreachable, or knows no usable checkpoint (a fresh machine, a lost
index), the manifests on the tiers still do: a step is complete on a tier when its manifest and every
rank's checksum record are there, since each rank writes its record only after its parts are durable.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from typing import Awaitable, Callable, Sequence, TypeVar

from ..errors import CheckpointLost, FreshStart, IncompleteCheckpoint, IndexUnavailable, IntegrityError, TierError
from ..storage.index import CheckpointStatus, Index, listing_range, rank_metas, status_of
from ..layout import index_dir, job_prefix, manifest_key, parse_key, rank_meta_key, step_prefix
from ..manifest import Manifest, RankMeta
from ..lifecycle import lineage
from ..lifecycle.lineage import Copy
from ..lifecycle.rules import Best
from ..storage.tier_io import TierIO

T = TypeVar("T")
log = logging.getLogger(__name__)
RECENT = (8, 64, 512)  # a load's pick looks at the index's newest records this many at first (_pick_recent)


class PartsGone(IncompleteCheckpoint):
    """Every tier was looked at, and none holds some saved rank's parts of a checkpoint the index lists complete."""


class Catalog:
    def __init__(self, job: str, index: Index, io: TierIO, *, adopt: bool = False, on_lost: str = "previous"):
        self.job = job
        self.on_lost = on_lost  # [engine] on_lost: what a load does when the newest checkpoint is lost
        self.lost: list[CheckpointStatus] = []  # what the last pick found lost (listed complete, its parts gone)
        self.index = index
        self.io = io
        self.adopt = adopt  # manifests committed to another index may be loaded
        self._sizes: dict[tuple[int, float], tuple[int | None, dict]] = {}  # (step, created) → from its manifest
        self._checked: tuple[int, Manifest] | None = None  # the manifest pick() read and checked, for the load
        # what pick() found of the checkpoint it picked: per tier listed, the saved ranks whose parts it holds
        self.held: tuple[int, dict[str, frozenset[int]]] | None = None

    async def statuses(self) -> list[CheckpointStatus]:
        """Every checkpoint of the job, oldest first: from the index, or from the tiers' manifests."""
        try:
            return await self.index.list(self.job)
        except IndexUnavailable as e:
            log.warning("%s: listing checkpoints from the manifests on the tiers instead", e)
        return await self.statuses_from_tiers()

    async def status_of(self, step: int) -> CheckpointStatus | None:
        """One step's status, as `statuses` lists it: one index call whatever the history (the tiers' manifests
        when the index is unreachable)."""
        try:
            return await status_of(self.index, self.job, step)
        except IndexUnavailable as e:
            log.warning("%s: looking for step %d in the manifests on the tiers instead", e, step)
        return next((s for s in await self.statuses_from_tiers() if s.step == step), None)

    async def newest_step(self) -> int:
        """The newest step the index lists, complete or not (-1: none); one index call whatever the history.
        IndexUnavailable when the index is unreachable."""
        found = await listing_range(self.index, self.job, newest=1)
        return found[-1].step if found else -1

    async def statuses_from_tiers(self) -> list[CheckpointStatus]:
        """A step is listed from the incarnation folder that holds it best: one of this index over a foreign
        one, a whole one over a partial one, the newest session over older ones (a zombie's or a crashed
        attempt's leftovers)."""
        found: dict[int, dict[str, dict[str, bool]]] = {}  # step -> incarnation -> tier -> whole
        origin: dict[tuple[int, str], str | None] = {}
        manifests: dict[tuple[int, str], Manifest] = {}
        for name in self.io:
            try:
                keys = set(await self.io.list(name, job_prefix(self.job)))
            except TierError as e:
                log.warning("tier %s cannot be listed either: %s", name, e)
                continue
            for key in keys:
                parsed = parse_key(key)
                if parsed is None or parsed.kind != "manifest" or parsed.job != self.job:
                    continue
                try:
                    manifest = await self._parse(await self.io.read(name, key), f"manifest {key} on tier {name!r}")
                except TierError as e:
                    log.warning("%s", e)
                    continue
                step, incarnation = parsed.step, parsed.incarnation
                whole = Copy(self.job, step, incarnation, keys).whole(manifest)
                found.setdefault(step, {}).setdefault(incarnation, {})[name] = whole
                manifests.setdefault((step, incarnation), manifest)
                if manifest.index != self.index.identity:
                    origin[step, incarnation] = manifest.index or "an index of format 1 (unknown)"
        statuses = []
        for step, by_incarnation in sorted(found.items()):
            best = max(by_incarnation, key=lambda inc: ((step, inc) not in origin, any(by_incarnation[inc].values()),
                                                        inc))
            tiers = by_incarnation[best]
            manifest = manifests[step, best]
            statuses.append(CheckpointStatus(step, tuple(self.io.order(tiers)),
                                             frozenset(t for t, whole in tiers.items() if whole),
                                             created=manifest.created, foreign=origin.get((step, best)),
                                             incarnation=best, nbytes=manifest.nbytes, metadata=manifest.metadata))
        return statuses

    async def with_sizes(self, statuses: list[CheckpointStatus]) -> list[CheckpointStatus]:
        """`statuses` with size and metadata filled in where the index has no record of them (checkpoints
        saved by an earlier release): from the index's manifest, read once per checkpoint and remembered.
        Saves of this release record both at begin, so listing them reads no manifest."""
        out = []
        for status in statuses:
            if status.nbytes is None and status.is_complete and status.incarnation is None:
                key = (status.step, status.created)
                if key not in self._sizes:
                    try:
                        manifest = await self._parse(await self.index.get_manifest(self.job, status.step),
                                                     f"index manifest of step {status.step}")
                        self._sizes[key] = (manifest.nbytes, manifest.metadata)
                    except (IncompleteCheckpoint, IntegrityError, IndexUnavailable):
                        self._sizes[key] = (None, {})
                nbytes, metadata = self._sizes[key]
                status = dataclasses.replace(status, nbytes=nbytes, metadata=metadata)
            out.append(status)
        return out

    async def pick(self, step: int | None, allowed: Sequence[str], best: Best | None = None,
                   listings: dict[str, Sequence[str] | None] | None = None) -> CheckpointStatus:
        """The newest checkpoint (or `step`, or with `best` the best one) complete on one of `allowed`;
        IncompleteCheckpoint says why not, CheckpointLost when the index lists complete ones but none can be
        loaded. The newest is the newest that can really be loaded: its manifest and records are readable,
        every rank's parts are still held by some tier, and a whole checkpoint of this index's lineage that the
        index forgot counts too. `listings` replaces a tier's own listing: for a node-local tier, what every
        node holds (from one listing per node), since one node sees only its own copies; None for a tier some
        node could not list (then taken to hold the checkpoint, and parts fall back per part)."""
        self._checked = None
        self.held = None
        self.lost = []
        if step is None and best is None:
            found = await self._pick_recent(allowed, listings)
            if found is not None:
                return found
        statuses = await self.statuses()
        if best is not None:
            return await self._pick_best(statuses, allowed, best, listings)
        if step is None:
            return await self._pick_newest(statuses, allowed, listings)
        usable = [s for s in statuses if s.complete & set(allowed) and (s.foreign is None or self.adopt)]
        if all(s.step != step for s in usable):
            found = await self._from_tiers(statuses, allowed, step)
            if found is not None:
                return found
        for s in usable:
            if s.step == step:
                return s
        found = next((s for s in statuses if s.step == step), None)
        detail = "does not exist" if found is None else (
            f"is incomplete (targets {list(found.tiers)}, complete on {sorted(found.complete)}, "
            f"failed on {found.failed or 'none'})")
        raise IncompleteCheckpoint(f"job {self.job!r} step {step} {detail} on tiers {list(allowed)}")

    async def _pick_recent(self, allowed: Sequence[str],
                           listings: dict[str, Sequence[str] | None] | None) -> CheckpointStatus | None:
        """The newest loadable checkpoint judged from the index's newest records (8; 64 or 512 when none of them is
        complete on `allowed`) and the tiers' folders from the oldest of them on (a listing that starts there), so
        a load's pick costs the same whatever the history the job keeps. What it returns is what `_pick_newest`
        over everything would: every listed step newer than it is in the window, and so is every copy the index
        does not list. None (then everything is looked at) when the index cannot be read, or no checkpoint of the
        window can be loaded."""
        for count in RECENT:  # a tier that takes every 10th save only: a wider window finds its newest
            try:
                recent = await listing_range(self.index, self.job, newest=count)
            except IndexUnavailable:
                return None
            if any(s.complete & set(allowed) and (s.foreign is None or self.adopt) for s in recent):
                return await self._pick_newest(recent, allowed, listings, first=recent[0].step)
            if len(recent) < count:
                return None  # the whole history had none
        return None

    async def _pick_newest(self, statuses: list[CheckpointStatus], allowed: Sequence[str],
                           listings: dict[str, Sequence[str] | None] | None,
                           first: int | None = None) -> CheckpointStatus:
        """Newest first, the first candidate that checks out: one the index lists complete (its manifest and
        records readable, a tier it names still holding its folder), or one of this index's lineage that the
        index does not list (a record lost or unreadable, an index restarted empty or restored from an older
        snapshot) and that is whole on a tier. Each one passed over is named in a warning. With `first`, `statuses`
        is the index's listing from step `first` on, the tiers are looked at from there, and None stands for "none
        of these" (the caller looks at everything then)."""
        copies, unlisted_tiers = await self._scan(allowed, listings, first)
        buried = await self._buried()
        listed = {s.step for s in statuses if "index" not in s.failed}  # an unreadable record lists nothing
        candidates: list[tuple[int, CheckpointStatus | None]] = [
            (s.step, s) for s in statuses if s.complete & set(allowed) and (s.foreign is None or self.adopt)]
        forgotten = {st for by_step in copies.values() for st in by_step} - listed - buried
        candidates += [(st, None) for st in forgotten]
        passed_over: list[str] = []
        unloadable: list[CheckpointStatus] = []  # listed complete by the index, yet not loadable now
        lost: list[CheckpointStatus] = []  # of which every tier was looked at and none holds some rank's parts
        for st, status in sorted(candidates, key=lambda c: (c[0], c[1] is not None), reverse=True):
            try:
                found = (await self._still_held(status, allowed, copies, unlisted_tiers) if status is not None
                         else await self._whole_on_tiers(st, allowed, copies))
            except (IncompleteCheckpoint, IntegrityError) as e:
                passed_over.append(f"step {st}: {e}")
                if status is not None and set(self.io.names) <= set(allowed):  # not lost: on tiers not asked
                    unloadable.append(status)
                    # lost (removed by the next save, or a fresh start) only where every tier was listed whole
                    if isinstance(e, PartsGone) and not any(self.io.listed_partly(t) for t in allowed):
                        lost.append(status)
                continue
            if unloadable and self.on_lost == "error":
                newer = [s.step for s in unloadable]
                raise CheckpointLost(f"job {self.job!r}: the newest checkpoint(s) {newer} cannot be loaded "
                                     f"({'; '.join(passed_over[:5])}); step {found.step} can. [engine] on_lost = "
                                     f"\"error\": nothing is loaded; \"previous\" would load step {found.step}")
            self.lost = lost
            if passed_over:
                log.warning("job %r: loading step %d; newer checkpoint(s) cannot be loaded: %s", self.job, found.step,
                            "; ".join(passed_over[:5]))
            if status is None:
                log.warning("job %r: step %d is whole on %s but the index does not list it (a record lost, or an "
                            "index restarted empty or restored from an older snapshot); loading it from the tiers",
                            self.job, st, ", ".join(found.complete))
            return found
        if first is not None:
            return None  # type: ignore[return-value]
        found = await self._from_tiers(statuses, allowed, None)  # other indexes' (adopt), earlier formats
        if found is not None:
            return found
        detail = f"; passed over: {'; '.join(passed_over[:5])}" if passed_over else ""
        if lost and len(lost) == len(unloadable) and self.on_lost == "fresh":
            self.lost = lost
            raise FreshStart(f"job {self.job!r}: the index lists {len(lost)} complete checkpoint(s) on tiers "
                             f"{list(allowed)}, but none can be loaded{detail}. [engine] on_lost = \"fresh\": "
                             f"starting fresh; the first save removes the lost checkpoint(s) "
                             f"{[s.step for s in lost]}")
        if unloadable:
            raise CheckpointLost(f"job {self.job!r}: the index lists {len(unloadable)} complete checkpoint(s) on tiers "
                                 f"{list(allowed)}, but none can be loaded{detail}. Delete them (tiered-ckpt delete "
                                 f"STEP) to start fresh, or set [engine] on_lost = \"fresh\" to do it unattended")
        raise IncompleteCheckpoint(f"job {self.job!r} has no complete checkpoint on tiers {list(allowed)} "
                                   f"({len(statuses)} listed, none complete){detail}")

    async def _pick_best(self, statuses: list[CheckpointStatus], allowed: Sequence[str], best: Best,
                         listings: dict[str, Sequence[str] | None] | None) -> CheckpointStatus:
        """The best checkpoint by `best`'s metric, of those the index lists complete on `allowed` (those the tiers'
        manifests list when the index is down), from their metadata: no manifest is read to rank them. Best first,
        the first that a tier still holds and whose manifest and records read back; each one passed over is named
        in a warning. Checkpoints without the metric are not candidates."""
        usable = {s.step: s for s in statuses if s.complete & set(allowed) and (s.foreign is None or self.adopt)}
        ranked = best.ranked([(s.step, s.metadata) for s in usable.values()])
        if not ranked:
            raise IncompleteCheckpoint(f"job {self.job!r}: no complete checkpoint on tiers {list(allowed)} has a "
                                       f"number under {best.metric!r} in its metadata ({len(usable)} complete; "
                                       f"pass metadata={{{best.metric!r}: ...}} to save())")
        copies, unlisted_tiers = await self._scan(allowed, listings)
        passed_over: list[str] = []
        for st in ranked:
            try:
                found = await self._still_held(usable[st], allowed, copies, unlisted_tiers)
            except (IncompleteCheckpoint, IntegrityError) as e:
                passed_over.append(f"step {st}: {e}")
                continue
            if passed_over:
                log.warning("job %r: loading step %d, the best by %s that can be loaded; better one(s) cannot: %s",
                            self.job, st, best.metric, "; ".join(passed_over[:5]))
            return found
        error = CheckpointLost if set(self.io.names) <= set(allowed) else IncompleteCheckpoint
        raise error(f"job {self.job!r}: no checkpoint with {best.metric!r} in its metadata can be "
                    f"loaded from tiers {list(allowed)}: {'; '.join(passed_over[:5])}")

    async def _scan(self, allowed: Sequence[str], listings: dict[str, Sequence[str] | None] | None = None,
                    first: int | None = None) -> tuple[dict[str, dict[int, list[Copy]]], set[str]]:
        """This index's copies on every allowed tier (one listing each, or the one given in `listings`; with
        `first`, of steps from `first` on only), and the tiers that could not be listed."""
        copies: dict[str, dict[int, list[Copy]]] = {}
        failed: set[str] = set()
        for tier in self.io.order(allowed):
            if listings is not None and tier in listings and listings[tier] is None:
                failed.add(tier)  # a node could not list it: what that node holds is unknown
                continue
            try:
                copies[tier] = await lineage.scan(self.io, tier, self.job, self.index.identity,
                                                  (listings or {}).get(tier), first=first)
            except TierError as e:
                log.warning("tier %s cannot be listed: %s", tier, e)
                failed.add(tier)
        return copies, failed

    async def _still_held(self, status: CheckpointStatus, allowed: Sequence[str],
                          copies: dict[str, dict[int, list[Copy]]], unlisted: set[str]) -> CheckpointStatus:
        """`status` as the index lists it, if every saved rank's parts are still held by one of its tiers (the
        records say so: node-local tiers judged from every node's listing); IncompleteCheckpoint naming the ranks
        whose parts none holds (nodes lost; an index restored from an older snapshot lists checkpoints retention
        removed since). Remembers in `held` what each tier holds, for the reads."""
        order = self.io.order(status.complete & set(allowed))
        manifest = await self.read_manifest(status.step, order, status.incarnation)
        if status.incarnation is not None or not manifest.incarnation.startswith(index_dir(self.index.identity) + "/"):
            self._checked = (status.step, manifest)
            return status  # found on the tiers already, or another index's or an earlier format's folder
        by_tier = {t: frozenset().union(*(c.ranks_held(manifest) for c in copies.get(t, {}).get(status.step, [])))
                   for t in order if t not in unlisted}
        if not any(t in unlisted for t in order):
            held: set[int] = set().union(*by_tier.values())
            gone = [r.rank for r in manifest.ranks if r.rank not in held]
            if gone:
                shown = f"{gone[:8]}{' and more' if len(gone) > 8 else ''}"
                raise PartsGone(
                    f"the index lists it complete on {order}, but none of them holds the parts of rank(s) {shown} "
                    f"any more (every node's node-local copies looked at): lost with their nodes, or removed (an "
                    f"index restored from an older snapshot?)")
        # Whole across the tiers, each rank's parts somewhere: a part missing where the index says it is falls back
        # per part to the next tier, as always.
        self._checked = (status.step, manifest)
        self.held = (status.step, by_tier)
        return status

    async def _whole_on_tiers(self, step: int, allowed: Sequence[str],
                              copies: dict[str, dict[int, list[Copy]]]) -> CheckpointStatus:
        """A step of this index's lineage that the index does not list: its newest copy that is whole."""
        reasons = []
        for tier in self.io.order(allowed):
            for copy in copies.get(tier, {}).get(step, []):
                try:
                    manifest = await lineage.read_manifest(self.io, tier, copy)
                except TierError as e:
                    reasons.append(str(e))
                    continue
                if manifest.index != self.index.identity or not copy.committed or not copy.whole(manifest):
                    continue
                holding = [t for t in self.io.order(allowed) if any(c.incarnation == copy.incarnation and c.committed
                                                                    and c.whole(manifest)
                                                                    for c in copies.get(t, {}).get(step, []))]
                return CheckpointStatus(step, tuple(holding), frozenset(holding), created=manifest.created,
                                        incarnation=copy.incarnation, nbytes=manifest.nbytes,
                                        metadata=manifest.metadata)
        missing = "; ".join(reasons) or "a record or the commit marker missing"
        raise IncompleteCheckpoint(f"no tier holds a whole, committed copy ({missing})")

    async def _from_tiers(self, statuses: list[CheckpointStatus], allowed: Sequence[str],
                          step: int | None) -> CheckpointStatus | None:
        """From the tiers' manifests alone (every folder, other indexes' too): a fresh machine, a lost index,
        checkpoints of earlier formats. Another index's checkpoints only with `adopt`."""
        buried = await self._buried()
        on_tiers = [s for s in await self.statuses_from_tiers() if s.complete & set(allowed) and s.step not in buried]
        from_tiers = [s for s in on_tiers if s.foreign is None or self.adopt]
        if on_tiers and not from_tiers:
            log.warning("%s", await _foreign_warning(self.job, on_tiers))
        wanted = sorted((s for s in from_tiers if step is None or s.step == step), key=lambda s: s.step, reverse=True)
        passed_over = []
        for status in wanted:  # newest first: the first whose manifest and records read back intact
            try:
                manifest = await self.read_manifest(status.step, self.io.order(status.complete), status.incarnation)
            except (IncompleteCheckpoint, IntegrityError) as e:
                passed_over.append(f"step {status.step}: {e}")
                continue
            self._checked = (status.step, manifest)
            log.warning("job %r: the index has no usable checkpoint%s; using the manifests on the tiers%s", self.job,
                        "" if step is None else f" {step}",
                        f" (passed over: {'; '.join(passed_over[:5])})" if passed_over else "")
            return status
        if passed_over:
            log.warning("job %r: no checkpoint on the tiers can be read back: %s", self.job, "; ".join(passed_over[:5]))
        return None

    async def _parse(self, data: bytes, source: str) -> Manifest:
        """Decode a manifest in a thread (100k tensors: a tenth of a second of Python)."""
        return await self.io.run_blocking(lambda: Manifest.from_bytes(data, source=source))

    async def _buried(self) -> set[int]:
        """Checkpoints being removed: never to be taken from the tiers. Unknown while the index is down."""
        try:
            return await self.index.buried(self.job)
        except IndexUnavailable:
            return set()

    async def read_manifest(self, step: int, tiers: Sequence[str] = (), incarnation: str | None = None) -> Manifest:
        """The manifest with every rank's checksums: from the index, or else from the first of `tiers` with a
        valid copy (so a tier alone can restore). `incarnation` says which folder to read on the tiers; when
        not known, the tiers' folders of this index are tried, newest first."""
        if self._checked is not None and self._checked[0] == step:  # read and checked by pick() just now
            checked, self._checked = self._checked[1], None
            if incarnation is None or checked.incarnation == incarnation:
                return checked
        errors: list[str] = []

        def parse_manifest(data: bytes, source: str) -> Manifest:
            return Manifest.from_bytes(data, source=source).expect(self.job, step, source)

        manifest = await self._first_valid(lambda: self.index.get_manifest(self.job, step), [], "", parse_manifest,
                                           "manifest", errors, final=False)
        if manifest is None:
            folders = [incarnation] if incarnation is not None else await self._incarnations(step, tiers)
            for folder in folders:
                key = manifest_key(self.job, step, folder)
                manifest = await self._first_valid(
                    None, tiers, key, lambda data, src, folder=folder: Manifest.from_bytes(data, source=src).expect(
                        self.job, step, src, incarnation=folder), "manifest", errors, final=False)
                if manifest is not None:
                    break
        if manifest is None:
            raise IncompleteCheckpoint(f"job {self.job!r} step {step}: no readable manifest ({'; '.join(errors)})")
        records, damaged = await self._records_from_index(step, [r.rank for r in manifest.ranks], errors)
        for rank in damaged:  # the index's copy missing or damaged: the first intact copy on the tiers
            records[rank] = await self._first_valid(
                None, tiers, rank_meta_key(self.job, step, rank, manifest.incarnation),
                lambda data, src, rank=rank: RankMeta.from_bytes(data, source=src).expect(rank, src),
                f"checksums of rank {rank}", errors)
        return manifest.with_checksums(records)

    async def _records_from_index(self, step: int, ranks: list[int], errors: list[str],
                                  ) -> tuple[dict[int, RankMeta], list[int]]:
        """Every saved rank's checksum record from the index in one batched read (before: one round trip per
        rank, 22.9 s at 10,240 ranks on Redis), each checked against its seal; with the ranks whose record the
        index lacks or holds damaged (each named in `errors`)."""
        try:
            stored = await rank_metas(self.index, self.job, step, ranks)
        except IndexUnavailable as e:
            errors.append(str(e))
            stored = {}

        def parse() -> tuple[dict[int, RankMeta], list[int]]:
            records: dict[int, RankMeta] = {}
            damaged: list[int] = []
            for rank in ranks:
                source = f"index checksums of rank {rank}"
                try:
                    if rank not in stored:
                        raise IncompleteCheckpoint(f"job {self.job!r} step {step}: no checksums of rank {rank} "
                                                   f"in the index")
                    records[rank] = RankMeta.from_bytes(stored[rank], source=source).expect(rank, source)
                except (IncompleteCheckpoint, IntegrityError) as e:
                    errors.append(str(e))
                    damaged.append(rank)
            return records, damaged
        return await asyncio.to_thread(parse)

    async def _incarnations(self, step: int, tiers: Sequence[str]) -> list[str]:
        """The folders holding a manifest of `step` on `tiers`: this index's first, newest session first."""
        folders: set[str] = set()
        for name in tiers:
            try:
                keys = await self.io.list(name, step_prefix(self.job, step))
            except TierError:
                continue
            folders.update(p.incarnation for p in map(parse_key, keys) if p is not None and p.kind == "manifest")
        mine = index_dir(self.index.identity)
        return sorted(folders, key=lambda f: (f.startswith(mine + "/"), f), reverse=True)

    async def _first_valid(self, from_index: Callable[[], Awaitable[bytes]] | None, tiers: Sequence[str], key: str,
                           parse: Callable[[bytes, str], T], what: str, errors: list[str], *,
                           final: bool = True) -> T:
        """The first intact copy: the index's, then each tier's. Every copy that failed is named in `errors`;
        with final=False None stands for "none", so the caller can try elsewhere first."""
        if from_index is not None:
            try:
                return await asyncio.to_thread(parse, await from_index(), f"index {what}")
            except (IncompleteCheckpoint, IntegrityError, IndexUnavailable) as e:
                errors.append(str(e))
        for name in tiers:
            try:
                return await asyncio.to_thread(parse, await self.io.read(name, key), f"{what} on tier {name!r}")
            except TierError as e:
                errors.append(str(e))
        if not final:
            return None  # type: ignore[return-value]
        raise IncompleteCheckpoint(f"job {self.job!r}: no readable {what} ({'; '.join(errors)})")


async def _foreign_warning(job: str, found: Sequence[CheckpointStatus]) -> str:
    """What to say of complete checkpoints on the tiers that another index committed. A file index that still
    exists on this machine is another run's, alive (another user's or job's run sharing a tier's folder):
    adopting would load a stranger's state, so no adopt is suggested then; only an index that is gone (moved,
    lost) is worth adopting from."""
    foreign = sorted({s.foreign for s in found if s.foreign})
    live = [f for f in foreign
            if f.startswith("file://") and await asyncio.to_thread(os.path.isdir, f.removeprefix("file://"))]
    if live:
        return (f"job {job!r}: the tiers hold {len(found)} complete checkpoint(s) of another run, committed to its "
                f"index {', '.join(live)}, which still exists: not loaded (they are that run's; load them with its "
                f"config, or give this run a tier folder of its own)")
    return (f"job {job!r}: the tiers hold {len(found)} complete checkpoint(s) committed to another index "
            f"({found[-1].foreign}); set adopt = true in [engine] to load them")
