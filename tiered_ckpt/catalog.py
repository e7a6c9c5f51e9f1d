"""What checkpoints a job has and what they hold: from the index, or from the tiers when the index can't say.

The index is the authority. When it is unreachable, or knows no usable checkpoint (a fresh machine, a lost
index), the manifests on the tiers still do: a step is complete on a tier when its manifest and every
rank's checksum record are there, since each rank writes its record only after its parts are durable.
"""
from __future__ import annotations

import logging
from typing import Awaitable, Callable, Sequence, TypeVar

from .errors import IncompleteCheckpoint, IndexUnavailable, IntegrityError, TierError
from .index import CheckpointStatus, Index
from .layout import job_prefix, manifest_key, parse_key, rank_meta_key
from .manifest import Manifest, RankMeta
from .tier_io import TierIO

T = TypeVar("T")
log = logging.getLogger(__name__)


class Catalog:
    def __init__(self, job: str, index: Index, tiers: TierIO, *, adopt: bool = False):
        self.job = job
        self.index = index
        self.tiers = tiers
        self.adopt = adopt  # manifests committed to another index may be loaded

    async def statuses(self) -> list[CheckpointStatus]:
        """Every checkpoint of the job, oldest first: from the index, or from the tiers' manifests."""
        try:
            return await self.index.list(self.job)
        except IndexUnavailable as e:
            log.warning("%s: listing checkpoints from the manifests on the tiers instead", e)
        return await self.statuses_from_tiers()

    async def statuses_from_tiers(self) -> list[CheckpointStatus]:
        found: dict[int, dict[str, bool]] = {}
        origin: dict[int, str | None] = {}
        for name in self.tiers:
            tier = self.tiers[name]
            try:
                keys = set(await tier.list(job_prefix(self.job)))
            except TierError as e:
                log.warning("tier %s cannot be listed either: %s", name, e)
                continue
            for key in keys:
                parsed = parse_key(key)
                if parsed is None or parsed.kind != "manifest" or parsed.job != self.job:
                    continue
                try:
                    manifest = Manifest.from_bytes(await tier.read(key), source=f"manifest on tier {name!r}")
                except (TierError, IntegrityError):
                    continue
                whole = all(rank_meta_key(self.job, parsed.step, r.rank) in keys for r in manifest.ranks)
                found.setdefault(parsed.step, {})[name] = whole
                if manifest.index != self.index.identity:
                    origin[parsed.step] = manifest.index or "an index of format 1 (unknown)"
        return [CheckpointStatus(step, tuple(self.tiers.order(tiers)),
                                 frozenset(t for t, whole in tiers.items() if whole), foreign=origin.get(step))
                for step, tiers in sorted(found.items())]

    async def pick(self, step: int | None, allowed: Sequence[str]) -> CheckpointStatus:
        """The newest checkpoint (or `step`) complete on one of `allowed`; IncompleteCheckpoint says why not."""
        statuses = await self.statuses()
        usable = [s for s in statuses if s.complete & set(allowed) and (s.foreign is None or self.adopt)]
        if not usable or (step is not None and all(s.step != step for s in usable)):
            # A fresh machine (an empty index) or a lost index: the tiers' manifests still know
            buried = await self._buried()
            on_tiers = [s for s in await self.statuses_from_tiers() if s.complete & set(allowed) and s.step not in buried]
            from_tiers = [s for s in on_tiers if s.foreign is None or self.adopt]
            if on_tiers and not from_tiers:
                log.warning("job %r: the tiers hold %d complete checkpoint(s) committed to another index (%s); "
                            "set adopt = true in [engine] to load them", self.job, len(on_tiers), on_tiers[-1].foreign)
            if from_tiers if step is None else any(s.step == step for s in from_tiers):
                log.warning("job %r: the index has no usable checkpoint%s; using the manifests on the tiers",
                            self.job, "" if step is None else f" {step}")
                usable = from_tiers  # errors below still describe what the index knows
        if step is None:
            if not usable:
                raise IncompleteCheckpoint(f"job {self.job!r} has no complete checkpoint on tiers {list(allowed)} "
                                           f"({len(statuses)} incomplete)")
            newest = max(usable, key=lambda s: s.step)
            await self._report_newer_on_tiers(newest.step, statuses)
            return newest
        for s in usable:
            if s.step == step:
                return s
        found = next((s for s in statuses if s.step == step), None)
        detail = "does not exist" if found is None else (
            f"is incomplete (targets {list(found.tiers)}, complete on {sorted(found.complete)}, "
            f"failed on {found.failed or 'none'})")
        raise IncompleteCheckpoint(f"job {self.job!r} step {step} {detail} on tiers {list(allowed)}")

    async def _report_newer_on_tiers(self, picked: int, statuses: Sequence[CheckpointStatus]) -> None:
        """A newer checkpoint of this index whose record the index lost (deleted or unreadable) would make a
        load roll back without a word: look on the fastest tier (a cheap listing) and say so."""
        complete_in_index = {s.step for s in statuses if s.is_complete}
        first = next(iter(self.tiers), None)
        if first is None:
            return
        try:
            keys = await self.tiers[first].list(job_prefix(self.job))
            buried = await self._buried()
        except (TierError, IndexUnavailable):
            return
        newer = sorted({p.step for p in map(parse_key, keys) if p is not None and p.kind == "manifest"
                        and p.step > picked and p.step not in complete_in_index and p.step not in buried})
        for step in newer:
            try:
                manifest = Manifest.from_bytes(await self.tiers[first].read(manifest_key(self.job, step)))
            except (TierError, IntegrityError):
                continue
            if manifest.index == self.index.identity:
                log.warning("job %r: loading step %d, but tier %s holds a manifest of step %d committed to this "
                            "index, which the index does not list as complete (its record was lost or cannot be "
                            "read); load(step=%d) loads it if it is whole", self.job, picked, first, step, step)

    async def _buried(self) -> set[int]:
        """Checkpoints being removed: never to be taken from the tiers. Unknown while the index is down."""
        try:
            return await self.index.buried(self.job)
        except IndexUnavailable:
            return set()

    async def read_manifest(self, step: int, tiers: Sequence[str] = ()) -> Manifest:
        """The manifest with every rank's checksums: from the index, or else from the first of `tiers`
        with a valid copy (so a tier alone can restore)."""
        errors: list[str] = []
        manifest = await self._first_valid(
            lambda: self.index.get_manifest(self.job, step), tiers, manifest_key(self.job, step),
            lambda data, src: Manifest.from_bytes(data, source=src), "manifest", errors)
        records = {}
        for r in manifest.ranks:
            records[r.rank] = await self._first_valid(
                lambda r=r: self.index.get_rank_meta(self.job, step, r.rank), tiers,
                rank_meta_key(self.job, step, r.rank), lambda data, src: RankMeta.from_bytes(data, source=src),
                f"checksums of rank {r.rank}", errors)
        return manifest.with_checksums(records)

    async def _first_valid(self, from_index: Callable[[], Awaitable[bytes]], tiers: Sequence[str], key: str,
                           parse: Callable[[bytes, str], T], what: str, errors: list[str]) -> T:
        try:
            return parse(await from_index(), f"index {what}")
        except (IncompleteCheckpoint, IntegrityError, IndexUnavailable) as e:
            errors.append(str(e))
        for name in tiers:
            try:
                return parse(await self.tiers[name].read(key), f"{what} on tier {name!r}")
            except TierError as e:
                errors.append(str(e))
        raise IncompleteCheckpoint(f"job {self.job!r}: no readable {what} ({'; '.join(errors)})")

