"""Re-read every part of a checkpoint on every tier that holds it and check length and checksum, and check
the sealed metadata copies (the manifest and every rank's record) on each tier and in the index."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable

from ..errors import IncompleteCheckpoint, IndexUnavailable, IntegrityError, TierError
from ..storage.index import CheckpointStatus, Index, rank_metas
from ..layout import PartKey, manifest_key, rank_meta_key
from ..manifest import Manifest, RankMeta
from ..storage.tier_io import TierIO
from ..storage.verified_read import PartRead, ReadLog


VERIFY_PARTS = 4  # parts read at once (each tier's pipeline bounds its own concurrency too)


@dataclass
class TierReport:
    tier: str
    complete: bool
    parts: int = 0
    bad: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.bad


async def verify(io: TierIO, status: CheckpointStatus, manifest: Manifest,
                 progress: Callable[[int], None] = lambda n: None) -> list[TierReport]:
    """One report per configured tier the checkpoint targets (complete or not), fastest first. At most
    VERIFY_PARTS parts are read at once, each into a buffer of its own: memory stays a few parts, whatever
    the checkpoint's size."""
    reports = []
    slots = asyncio.Semaphore(VERIFY_PARTS)
    for tier in io.order(status.tiers):
        report = TierReport(tier, tier in status.complete)

        async def check(rank: int, p: int, expected: int) -> None:
            length = manifest.part_length(rank, p)
            async with slots:
                # a part-sized buffer is allocated and freed in a thread: on the event loop either takes milliseconds
                buffer = memoryview(await io.run_blocking(bytearray, length))
                part = PartRead(PartKey(manifest.job, manifest.step, rank, p, manifest.incarnation).path,
                                [buffer], length, expected, bounce=True, algorithm=manifest.checksum,
                                chunk_size=manifest.chunk_size, chunk_sums=manifest.chunk_sums_of(rank, p),
                                check_whole=True)
                del buffer
                log = ReadLog()
                try:
                    await io.read_verified(part, [tier], log)
                except IntegrityError:
                    report.bad.extend(f"{f.part}: {f.reason}" for f in log.fallbacks)
                finally:
                    await io.run_blocking(part.views.clear)
                    progress(length)

        checks = [check(r.rank, p, c) for r in manifest.ranks for p, c in enumerate(r.checksums)]
        report.parts = len(checks)
        await asyncio.gather(*checks)
        report.bad.extend(await _check_records(io, tier, manifest))
        reports.append(report)
    return reports


async def _check_records(io: TierIO, tier: str, manifest: Manifest) -> list[str]:
    """The tier's copies of the manifest and the rank records: present and intact."""
    bad = []
    records = [(manifest_key(manifest.job, manifest.step, manifest.incarnation), lambda data, src: Manifest.from_bytes(data, source=src))]
    records += [(rank_meta_key(manifest.job, manifest.step, r.rank, manifest.incarnation),
                 lambda data, src: RankMeta.from_bytes(data, source=src)) for r in manifest.ranks]
    for key, parse in records:
        try:
            data = await io.read(tier, key)
            await io.run_blocking(parse, data, key)
        except TierError as e:  # IntegrityError (corrupt) or TierNotFound
            bad.append(f"{key}: {type(e).__name__}: {e}")
    return bad


@dataclass
class IndexReport:
    """The index's copies of one checkpoint's manifest and rank records (`unreachable`: not checked, and why)."""

    index: str
    records: int = 0
    bad: list[str] = field(default_factory=list)
    unreachable: str | None = None

    @property
    def ok(self) -> bool:
        return not self.bad


async def verify_index(index: Index, manifest: Manifest) -> IndexReport:
    """The index's copy of the manifest and of every rank's record: present and intact (each is sealed). A load
    skips a damaged copy for a tier's, so only verify tells that the index's copies are damaged. Two reads of the
    index whatever the number of ranks: the manifest, then every rank's record in one batched read."""
    job, step = manifest.job, manifest.step
    report = IndexReport(index.identity, records=1 + len(manifest.ranks))
    try:
        data = await index.get_manifest(job, step)
        await asyncio.to_thread(Manifest.from_bytes, data, source=f"index manifest of step {step}")
    except IndexUnavailable as e:
        report.unreachable = str(e)
        return report
    except (IncompleteCheckpoint, IntegrityError) as e:  # missing, or corrupt
        report.bad.append(f"manifest: {type(e).__name__}: {e}")
    try:
        stored = await rank_metas(index, job, step, [r.rank for r in manifest.ranks])
    except IndexUnavailable as e:
        report.unreachable = str(e)
        return report

    def check() -> list[str]:
        bad = []
        for r in manifest.ranks:
            what = f"checksums of rank {r.rank}"
            try:
                if r.rank not in stored:
                    raise IncompleteCheckpoint(f"job {job!r} step {step}: no {what} in the index")
                RankMeta.from_bytes(stored[r.rank], source=f"index {what} of step {step}")
            except (IncompleteCheckpoint, IntegrityError) as e:
                bad.append(f"{what}: {type(e).__name__}: {e}")
        return bad
    report.bad += await asyncio.to_thread(check)
    return report
