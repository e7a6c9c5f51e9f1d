"""Healing after a load: put back the cache copies that node loss took.

A node that is replaced comes back with an empty memory tier, and its Redis server, which held its ring
predecessor's peer copies, comes back empty too. Until the next save, a second failure would then find the
checkpoint on slow tiers only, or nowhere. After a load, each rank therefore checks the copies of its own
saved rank (rank r heals what saved rank r wrote) on the cache tiers the checkpoint is complete on (memory:
this node's copy; redis: the copy anywhere on the ring) and rewrites what is missing from the tiers that still
hold it, verified part by part: parts first, then the checksum record, then the manifest and the committed
marker, so a heal cut short never leaves a copy that looks whole. It runs in the background (the engine starts
it after load() returns), writes only keys of the loaded checkpoint's own folder (never a newer
checkpoint's), keeps the step busy in its process meanwhile, and writes a copy's records only while the index
still lists the checkpoint complete on that tier (another process's retention may have removed it).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Sequence

from ..errors import TieredCkptError, TierNotFound
from ..layout import committed_key, manifest_key, rank_meta_key
from ..manifest import Manifest
from ..storage.index import Index
from ..storage.tier_io import ReadLog, TierIO
from .broadcast import Holdings, tiers_for
from .reads import part_read

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


async def heal(io: TierIO, index: Index, manifest: Manifest, order: Sequence[str], holdings: Holdings,
               rank: int, held: Holdings | None = None) -> HealReport:
    """Rewrite saved rank `rank`'s missing copies on the cache tiers in `order` (see the module's docstring).
    `holdings`: what this rank can read the checkpoint from (this node's node-local tiers, and what the shared
    tiers hold: the load's view); `held`: what each tier holds anywhere, every node's copies of a node-local tier
    together (the pick's view). A copy is missing when no node holds it: a rank that now runs on another machine
    than the one that saved reads across nodes rather than keeping a second copy in memory."""
    report = HealReport(manifest.step)
    if rank >= manifest.world_size:  # a rank the saved world lacked wrote nothing to heal
        return report
    job, step, inc = manifest.job, manifest.step, manifest.incarnation
    record = rank_meta_key(job, step, rank, inc)
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
            log.warning("step %d: rank %d's copy on tier %s could not be healed: %s", step, rank, tier, e)
    if report.parts:
        log.info("step %d: healed rank %d's copies on %s (%s)", step, rank, ", ".join(report.healed),
                 ", ".join(f"{t}: {report.parts[t]} part(s), {report.bytes[t]} bytes" for t in report.healed))
    return report


async def _copy_rank(io: TierIO, index: Index, manifest: Manifest, rank: int, tier: str, sources: Sequence[str],
                     report: HealReport) -> None:
    job, step, inc = manifest.job, manifest.step, manifest.incarnation
    for p in range(len(manifest.ranks[rank].checksums)):
        buf = bytearray(manifest.part_length(rank, p))
        part = part_read(manifest, rank, p, [memoryview(buf)])
        await io.read_verified(part, sources, ReadLog(), budgeted=False)
        await io.write(tier, part.key, memoryview(buf), f"heal part {p} of rank {rank}, step {step}")
        report.parts[tier] = report.parts.get(tier, 0) + 1
        report.bytes[tier] = report.bytes.get(tier, 0) + len(buf)
    if not await _still_complete(index, manifest, tier):  # retention (another process's) removed it meanwhile
        raise TierNotFound(f"step {step} is no longer complete on the tier in the index: its healed parts are left "
                           f"for gc", tier=tier)
    await io.write(tier, rank_meta_key(job, step, rank, inc),
                   memoryview(await _record(io, sources, rank_meta_key(job, step, rank, inc),
                                            lambda: index.get_rank_meta(job, step, rank))))
    if io.file_tier(tier) is not None or rank == 0:  # a node's own copy needs them; the ring, one copy
        await io.write(tier, manifest_key(job, step, inc),
                       memoryview(await _record(io, sources, manifest_key(job, step, inc),
                                                lambda: index.get_manifest(job, step))))
        await io.write(tier, committed_key(job, step, inc), memoryview(b""))


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
