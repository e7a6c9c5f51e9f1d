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

from ..errors import IncompleteCheckpoint, IndexUnavailable, IntegrityError, TierError
from ..storage.index import CheckpointStatus, Index
from ..layout import index_dir, job_prefix, manifest_key, parse_key, rank_meta_key, step_prefix
from ..manifest import Manifest, RankMeta
from ..storage.tier_io import TierIO

T = TypeVar("T")
log = logging.getLogger(__name__)


class Catalog:
    def __init__(self, job: str, index: Index, io: TierIO, *, adopt: bool = False):
        self.job = job
        self.index = index
        self.io = io
        self.adopt = adopt  # manifests committed to another index may be loaded
        self._sizes: dict[tuple[int, float], tuple[int | None, dict]] = {}  # (step, created) → from its manifest

    async def statuses(self) -> list[CheckpointStatus]:
        """Every checkpoint of the job, oldest first: from the index, or from the tiers' manifests."""
        try:
            return await self.index.list(self.job)
        except IndexUnavailable as e:
            log.warning("%s: listing checkpoints from the manifests on the tiers instead", e)
        return await self.statuses_from_tiers()

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
                whole = manifest.incarnation == incarnation and all(
                    rank_meta_key(self.job, step, r.rank, incarnation) in keys for r in manifest.ranks)
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
                log.warning("%s", await _foreign_warning(self.job, on_tiers))
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
        first = next(iter(self.io), None)
        if first is None:
            return
        try:
            keys = await self.io.list(first, job_prefix(self.job))
            buried = await self._buried()
        except (TierError, IndexUnavailable):
            return
        parsed = ((parse_key(k), k) for k in keys)
        newer = sorted((p.step, k) for p, k in parsed if p is not None and p.kind == "manifest"
                       and p.step > picked and p.step not in complete_in_index and p.step not in buried)
        for step, key in newer:
            try:
                manifest = await self._parse(await self.io.read(first, key), f"manifest {key} on tier {first!r}")
            except TierError:
                continue
            if manifest.index == self.index.identity:
                log.warning("job %r: loading step %d, but tier %s holds a manifest of step %d committed to this "
                            "index, which the index does not list as complete (its record was lost or cannot be "
                            "read); load(step=%d) loads it if it is whole", self.job, picked, first, step, step)

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
        errors: list[str] = []
        parse_manifest: Callable[[bytes, str], Manifest] = lambda data, src: Manifest.from_bytes(data, source=src)
        manifest = await self._first_valid(lambda: self.index.get_manifest(self.job, step), [], "", parse_manifest,
                                           "manifest", errors, final=False)
        if manifest is None:
            folders = [incarnation] if incarnation is not None else await self._incarnations(step, tiers)
            for folder in folders:
                manifest = await self._first_valid(None, tiers, manifest_key(self.job, step, folder), parse_manifest,
                                                   "manifest", errors, final=False)
                if manifest is not None:
                    break
        if manifest is None:
            raise IncompleteCheckpoint(f"job {self.job!r} step {step}: no readable manifest ({'; '.join(errors)})")
        records = {}
        for r in manifest.ranks:
            records[r.rank] = await self._first_valid(
                lambda r=r: self.index.get_rank_meta(self.job, step, r.rank), tiers,
                rank_meta_key(self.job, step, r.rank, manifest.incarnation),
                lambda data, src: RankMeta.from_bytes(data, source=src), f"checksums of rank {r.rank}", errors)
        return manifest.with_checksums(records)

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
