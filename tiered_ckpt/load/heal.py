"""Healing after a load: put back the cache copies that node loss took.

A node that is replaced comes back with an empty memory tier, and its Redis server, which held its ring
predecessor's peer copies, comes back empty too. Until the next save, a second failure would then find the
checkpoint on slow tiers only, or nowhere. After a load, the copies of each saved rank on the cache tiers the
checkpoint is complete on (memory, and the ring) are checked by one rank on the machine that wrote them
(`healer_of`; the memory copy belongs there, and its ring copy then goes to that machine's successor, never
beside it, whatever machines the ranks now run on), which rewrites what no node holds any more from the
tiers that still hold it, verified part by part: parts first, then the checksum record, then the manifest and
the committed marker, so a heal cut short never leaves a copy that looks whole; one that fails (a full tmpfs)
also removes the parts and record it wrote of that copy, so no half copy keeps the room it failed for. A part this node's cache copy
returned damaged during the load is written again too. It runs in the background (the engine starts
it after load() returns), writes only keys of the loaded checkpoint's own folder (never a newer
checkpoint's), keeps the step busy in its process meanwhile, and writes a copy's records only while the index
still lists the checkpoint complete on that tier (another process's retention may have removed it).
"""
from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Sequence

from ..errors import TieredCkptError, TierNotFound
from ..layout import PartKey, committed_key, manifest_key, parse_key, rank_meta_key
from ..lifecycle.copy_commit import CopyThenCommit, RankCopy
from ..manifest import Manifest
from ..storage.index import Index
from ..storage.tier_io import TierIO
from ..storage.verified_read import ReadLog
from .broadcast import Holdings, tiers_for
from .parts import part_read

log = logging.getLogger(__name__)
CACHE_KINDS = ("memory", "redis")


@dataclass
class HealReport:
    """What a heal rewrote: per tier, the parts and bytes put back; `errors` says what could not be."""

    step: int
    parts: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    @property
    def healed(self) -> list[str]:
        """The tiers that got copies back."""
        return sorted(self.parts)


def healer_of(saved_rank: int, manifest: Manifest, hosts: Sequence[str]) -> int:
    """The rank that heals `saved_rank`'s copies: the lowest rank on the machine that wrote them (its memory
    copy belongs there, and from there its ring copy goes to that machine's successor, never beside it),
    else, when that machine is not in this job (gone, renamed, or a checkpoint that names none), rank
    saved_rank modulo the world."""
    writer = manifest.ranks[saved_rank].host
    on_writer = [r for r, h in enumerate(hosts) if writer and h == writer]
    return on_writer[0] if on_writer else saved_rank % max(len(hosts), 1)


async def heal(io: TierIO, index: Index, manifest: Manifest, order: Sequence[str], holdings: Holdings,
               rank: int, held: Holdings | None = None, hosts: Sequence[str] = ("",),
               damaged: Sequence[tuple[str, str]] = ()) -> HealReport:
    """Rewrite the missing copies on the cache tiers in `order` of the saved ranks this rank heals (healer_of),
    and the parts in `damaged` ((tier, key): read back corrupt or missing from this node's copy by this load).
    `holdings`: what this rank can read the checkpoint from (this node's node-local tiers, and what the shared
    tiers hold: the load's view); `held`: what each tier holds anywhere, every node's copies of a node-local
    tier together (the pick's view). A copy is missing when no node holds it: ranks that now run on other
    machines than the ones that saved read across nodes rather than keeping a second copy in memory."""
    report = HealReport(manifest.step)
    for saved_rank in range(manifest.world_size):
        if healer_of(saved_rank, manifest, hosts) == rank:
            await _heal_rank(io, index, manifest, order, holdings, held, saved_rank, report)
    for tier, key in damaged:
        await _repair(io, manifest, order, holdings, tier, key, report)
    if report.parts:
        log.info("step %d: healed %s", manifest.step,
                 ", ".join(f"{t}: {report.parts[t]} part(s), {report.bytes[t]} bytes" for t in report.healed))
    return report


async def _heal_rank(io: TierIO, index: Index, manifest: Manifest, order: Sequence[str], holdings: Holdings,
                     held: Holdings | None, rank: int, report: HealReport) -> None:
    record = rank_meta_key(manifest.job, manifest.step, rank, manifest.incarnation)
    for tier in order:
        if io.configs[tier].kind not in CACHE_KINDS:
            continue
        try:
            if held and tier in held:
                lacking = rank not in held[tier]
            elif io.file_tier(tier) is not None:
                lacking = rank not in holdings.get(tier, frozenset())
            else:
                lacking = bool(await io.missing(tier, [record]))
            if not lacking:
                continue
            sources = [t for t in tiers_for(order, holdings, rank) if t != tier]
            await _copy_rank(io, index, manifest, rank, tier, sources, report)
        except TieredCkptError as e:
            report.errors.append(f"{tier}: {type(e).__name__}: {e}")
            log.warning("step %d: rank %d's copy on tier %s could not be healed: %s", manifest.step, rank, tier, e)


async def _repair(io: TierIO, manifest: Manifest, order: Sequence[str], holdings: Holdings, tier: str, key: str,
                  report: HealReport) -> None:
    """One part this node's copy on `tier` returned damaged (a flipped byte, a truncated or vanished file):
    written again from the next tier that returns it intact."""
    parsed = parse_key(key)
    if parsed is None or parsed.rank is None or parsed.index is None or io.configs[tier].kind not in CACHE_KINDS:
        return
    sources = [t for t in tiers_for(order, holdings, parsed.rank) if t != tier]
    try:
        buf = bytearray(manifest.part_length(parsed.rank, parsed.index))
        await io.read_verified(part_read(manifest, parsed.rank, parsed.index, [memoryview(buf)]), sources, ReadLog(),
                               budgeted=False)
        await io.write(tier, key, memoryview(buf), f"repair {key}")
    except TieredCkptError as e:
        report.errors.append(f"{tier}: {key}: {type(e).__name__}: {e}")
        log.warning("step %d: part %s on tier %s could not be repaired: %s", manifest.step, key, tier, e)
        return
    report.parts[tier] = report.parts.get(tier, 0) + 1
    report.bytes[tier] = report.bytes.get(tier, 0) + len(buf)


class _VerifiedParts:
    """A saved rank's parts read from `sources`, each verified before it is lent (a fresh buffer per part)."""

    def __init__(self, io: TierIO, manifest: Manifest, rank: int, sources: Sequence[str]):
        self.io, self.manifest, self.rank, self.sources = io, manifest, rank, sources

    @asynccontextmanager
    async def part(self, p: int) -> AsyncIterator[memoryview]:
        buf = bytearray(self.manifest.part_length(self.rank, p))
        await self.io.read_verified(part_read(self.manifest, self.rank, p, [memoryview(buf)]), self.sources,
                                    ReadLog(), budgeted=False)
        yield memoryview(buf)


async def _copy_rank(io: TierIO, index: Index, manifest: Manifest, rank: int, tier: str, sources: Sequence[str],
                     report: HealReport) -> None:
    """Rank `rank`'s copy on `tier`, from `sources` (lifecycle/copy_commit.py: parts, record, check, then the
    manifest and committed marker as the commit). A copy that cannot be finished (the tier full, a source gone,
    the checkpoint retired meanwhile) takes back what it wrote: _unwrite."""
    job, step, inc = manifest.job, manifest.step, manifest.incarnation
    n = len(manifest.ranks[rank].checksums)
    keys = tuple(PartKey(job, step, rank, p, inc).path for p in range(n))
    lengths = tuple(manifest.part_length(rank, p) for p in range(n))
    record = rank_meta_key(job, step, rank, inc)

    async def still_complete() -> None:
        if not await _still_complete(index, manifest, tier):  # retention (another process's) removed it meanwhile
            raise TierNotFound(f"step {step} is no longer complete on the tier in the index: its healed parts are "
                               f"removed", tier=tier)

    async def records() -> list[tuple[str, bytes]]:
        return [(record, await _record(io, sources, record, lambda: index.get_rank_meta(job, step, rank)))]

    async def commit() -> None:
        if io.file_tier(tier) is not None or rank == 0:  # a node's own copy needs them; the ring, one copy
            # shared by the ranks of the copy: never taken back (a write that fails leaves the one before)
            await io.write(tier, manifest_key(job, step, inc),
                           memoryview(await _record(io, sources, manifest_key(job, step, inc),
                                                    lambda: index.get_manifest(job, step))))
            await io.write(tier, committed_key(job, step, inc), memoryview(b""))

    copy = CopyThenCommit(io, RankCopy(tier, step, rank, keys, lengths), _VerifiedParts(io, manifest, rank, sources),
                          records, commit, what="heal", lend_per_attempt=False, concurrent=False,
                          before_records=still_complete)
    try:
        await copy.run()
    except BaseException:
        await _unwrite(io, tier, copy.written, step)
        raise
    report.parts[tier] = report.parts.get(tier, 0) + n
    report.bytes[tier] = report.bytes.get(tier, 0) + sum(lengths)


async def _unwrite(io: TierIO, tier: str, keys: Sequence[str], step: int) -> None:
    """Remove the keys a heal cut short wrote (each a key of its own: one rank's parts and record), so that no
    half copy stays behind to take the room (a full tmpfs is RAM) that made it fail. The manifest and the
    committed marker are written only after the rank's whole copy, and stay (other ranks' copies share them):
    without the rank's record the copy never looks whole. What cannot be removed is logged: gc removes it."""
    for key in reversed(keys):
        try:
            await io.delete(tier, key)
        except (TieredCkptError, OSError) as e:
            log.warning("step %d: %s on tier %s, written by a heal that failed, could not be removed (%s); gc "
                        "removes it", step, key, tier, e)


async def _still_complete(index: Index, manifest: Manifest, tier: str) -> bool:
    """Whether the index still lists the checkpoint complete on `tier` (a copy is finished only then)."""
    for status in await index.list(manifest.job):
        if status.step == manifest.step:
            return tier in status.complete
    return False


async def _record(io: TierIO, sources: Sequence[str], key: str, from_index: Callable[[], Awaitable[bytes]]) -> bytes:
    """A record's bytes from the first tier that has it, else from the index (sealed: readers check them)."""
    for tier in sources:
        try:
            return await io.read(tier, key)
        except TieredCkptError:
            continue
    return await from_index()
