"""What a tier holds of this job's lineage: the steps written under this index's folders (any incarnation:
`ix-<hash of the index identity>/<session>`), read from a listing of the tier alone.

An index can forget what the tiers still hold: a Redis restarted empty or restored from an older snapshot, a
record deleted, a crash between retention's unmark and the removal of the data. The tiers stay the truth
about bytes; the key layout says whose they are (layout.py), and a manifest plus every rank's checksum
record says a copy is whole (each rank writes its record only after its parts are durable), and a `committed`
marker that the index committed it (rank 0 writes it after the commit: a fenced zombie's copy, whole as it
may be, has none). Loads use this
to find a newer whole checkpoint the index no longer lists; retention uses it to keep a tier at keep_last
whatever the index forgot; a writer uses it to list such checkpoints in the index again.
"""
from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field
from itertools import islice
from typing import Iterable

from ..errors import TierError
from ..gc_pause import automatic_gc_paused
from ..layout import (committed_key, index_dir, job_prefix, manifest_key, parse_key, parse_step_dir, rank_meta_key,
                      step_dir, step_prefix)
from ..manifest import Manifest
from ..storage.index import Index, listing_range, step_numbers
from ..storage.tier_io import TierIO

log = logging.getLogger(__name__)


@dataclass
class Copy:
    """One incarnation's keys of one step on one tier: the one answer to "is this copy whole?" (the catalog,
    gc, retention and loads all ask it here)."""

    job: str
    step: int
    incarnation: str
    keys: set[str] = field(default_factory=set)

    @property
    def manifest(self) -> str:
        return manifest_key(self.job, self.step, self.incarnation)

    @property
    def committed(self) -> bool:
        """The index committed this copy (rank 0 left the marker): not a zombie's or a crashed attempt's."""
        return committed_key(self.job, self.step, self.incarnation) in self.keys

    def whole(self, manifest: Manifest) -> bool:
        """The manifest and every rank's checksum record are on the tier (so every rank's parts are)."""
        return len(self.ranks_held(manifest)) == len(manifest.ranks)

    def ranks_held(self, manifest: Manifest) -> set[int]:
        """The ranks whose checksum record (so whose parts) this copy holds."""
        if manifest.incarnation != self.incarnation:
            return set()
        return {r.rank for r in manifest.ranks if rank_meta_key(self.job, self.step, r.rank, self.incarnation) in self.keys}


async def scan(io: TierIO, tier: str, job: str, identity: str, keys: Iterable[str] | None = None, *,
               first: int | None = None) -> dict[int, list[Copy]]:
    """step → the copies this index's incarnations wrote on `tier`, newest session first (one listing; or
    `keys`, a listing made elsewhere: every node's listing of a node-local tier, put together). With `first`, only
    steps from `first` on (the listing starts there). The keys are parsed in a thread: a tier that keeps a long
    history holds tens of thousands, with automatic collection off (a collection there holds the GIL, and the event
    loop waits on it: gc_pause.py)."""
    if keys is not None:
        listed = keys
    elif first is None:
        listed = await io.list(tier, job_prefix(job))
    else:
        listed = await io.list_from(tier, job_prefix(job), step_prefix(job, max(first, 0)))
    def parse() -> dict[int, list[Copy]]:
        with automatic_gc_paused():
            return copies_of(listed, job, identity, first)
    return await io.run_blocking(parse)


def copies_of(keys: Iterable[str], job: str, identity: str, first: int | None = None) -> dict[int, list[Copy]]:
    """`scan`'s work on a listing: the copies of this index's incarnations (of steps from `first` on), by step,
    newest session first."""
    mine = index_dir(identity) + "/"
    found: dict[tuple[int, str], Copy] = {}
    for key in keys:
        parsed = parse_key(key)
        if parsed is None or parsed.job != job or not parsed.incarnation.startswith(mine):
            continue
        if first is not None and parsed.step < first:
            continue
        copy = found.setdefault((parsed.step, parsed.incarnation), Copy(job, parsed.step, parsed.incarnation))
        copy.keys.add(key)
    out: dict[int, list[Copy]] = {}
    for (step, _), copy in sorted(found.items(), key=lambda item: item[0], reverse=True):
        out.setdefault(step, []).append(copy)
    return out


NOTE = "lineage"  # the index note (Index.put_note) that says whether the index kept its history (see `relist`)
KEPT = b"kept"  # a writer's start compared the index's whole history with the tiers, and nothing was lost since
FORGOT = b"forgot"  # retention found the index no longer listing steps it had listed: compare everything again


INLINE = 512  # step folders from which their names are compared in a thread (off the event loop)
FEW = 64  # steps unknown to the index from which a tier is listed whole rather than step folder by step folder


async def copies_beyond(io: TierIO, tier: str, job: str, identity: str, known: set[int], *,
                        first: int | None = None) -> dict[int, list[Copy]]:
    """The copies on `tier` of steps not in `known`: the tier's step folders' names first (one listing of a folder,
    compared in a thread), then the keys of those steps alone (or the whole tier's, when there are many: an index
    restarted empty). With `first`, only the step folders from `first` on are asked for (a local tier answers from
    the names its last writer kept, `LocalTier._names_from`; S3 lists from there), so a look at a window costs the
    window, not the history."""
    names = await io.list_names(tier, job_prefix(job), None if first is None else step_dir(max(first, 0)))

    start = 0 if first is None else bisect.bisect_left(names, step_dir(max(first, 0)))

    def unknown() -> list[int]:
        with automatic_gc_paused():
            return [st for n in islice(names, start, None) if (st := parse_step_dir(n)) is not None and st not in known]
    steps = unknown() if len(names) - start < INLINE else await io.run_blocking(unknown)  # (a window's few: inline)
    if not steps:
        return {}
    if len(steps) > FEW:
        copies = await scan(io, tier, job, identity, first=first)
        return {st: c for st, c in copies.items() if st not in known}
    keys: list[str] = []
    for st in steps:
        keys += await io.list(tier, step_prefix(job, st))
    return await scan(io, tier, job, identity, keys)


async def read_manifest(io: TierIO, tier: str, copy: Copy) -> Manifest:
    """The copy's manifest, checked to be the one its key says (job, step, folder); IntegrityError if not."""
    data = await io.read(tier, copy.manifest)
    source = f"manifest {copy.manifest} on tier {tier!r}"
    return await io.run_blocking(lambda: Manifest.from_bytes(data, source=source).expect(
        copy.job, copy.step, source, incarnation=copy.incarnation))


async def relist(io: TierIO, index: Index, job: str, session: str, listed: Iterable[int] | None = None, *,
                 since: int | None = None, missed: list[str] | None = None) -> list[int]:
    """Put back into the index the checkpoints of this lineage that it forgot: committed copies, whole on some
    tier, of steps it neither lists nor buries. A writer does this once, at its start; returns those steps.
    `listed`: the steps the index holds records of, when the caller has them. What is compared is step numbers
    (the index's, a tier's step folders' names): only the folders of steps the index does not hold are listed and
    read, so a start costs the same however many checkpoints both agree on. With `since` (the index's newest
    record, when the index kept its history: `Writer._clean_leftovers`), only steps from there on are looked for:
    what a restore from an older snapshot, or commits the index lost at its newest end, leave out. `missed`: the
    tiers that could not be listed are added to it."""
    if since is None:
        known = set(await step_numbers(index, job) if listed is None else listed)
    else:
        known = {s.step for s in await listing_range(index, job, since)}
    known |= await index.buried(job)
    found: dict[int, tuple[Copy, Manifest, list[str]]] = {}
    for tier in io.names:
        try:
            copies = await copies_beyond(io, tier, job, index.identity, known, first=since)
        except TierError as e:
            log.warning("tier %s cannot be listed to find checkpoints the index forgot: %s", tier, e)
            if missed is not None:
                missed.append(tier)
            continue
        for step, candidates in copies.items():
            for copy in candidates:
                if step in found and found[step][0].incarnation != copy.incarnation:
                    continue
                if not copy.committed:
                    continue
                try:
                    manifest = found[step][1] if step in found else await read_manifest(io, tier, copy)
                except TierError:
                    continue
                if manifest.index == index.identity and copy.whole(manifest):
                    found.setdefault(step, (copy, manifest, []))[2].append(tier)
                    break
    for step, (copy, manifest, tiers) in sorted(found.items()):
        records = [await io.read(tiers[0], rank_meta_key(job, step, r.rank, copy.incarnation)) for r in manifest.ranks]
        await index.begin(job, step, tiers, {"nbytes": manifest.nbytes, "metadata": dict(manifest.metadata),
                                             "folder": copy.incarnation})
        await index.put_manifest(job, step, await io.read(tiers[0], copy.manifest))
        for rank, record in enumerate(records):
            await index.put_rank_meta(job, step, rank, record)
        for tier in tiers:
            for rank in range(manifest.world_size):
                await index.mark_durable(job, step, tier, rank, manifest.world_size, f"{session}-relisted")
        log.warning("job %r: step %d is whole and committed on %s but the index had forgotten it (restarted empty or "
                    "restored from an older snapshot?); it is listed again", job, step, ", ".join(tiers))
    return sorted(found)
