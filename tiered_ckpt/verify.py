"""Re-read every part of a checkpoint on every tier that holds it and check length and checksum."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable

from .errors import IntegrityError
from .index import CheckpointStatus
from .layout import PartKey
from .manifest import Manifest
from .tier_io import PartRead, ReadLog, TierIO


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
    """One report per configured tier the checkpoint targets (complete or not), fastest first."""
    reports = []
    for tier in io.order(status.tiers):
        report = TierReport(tier, tier in status.complete)

        async def check(rank: int, p: int, expected: int) -> None:
            length = manifest.part_length(rank, p)
            part = PartRead(PartKey(manifest.job, manifest.step, rank, p).path, [memoryview(bytearray(length))],
                            length, expected)
            log = ReadLog()
            try:
                await io.read_verified(part, [tier], log)
            except IntegrityError:
                report.bad.extend(f"{f.part}: {f.reason}" for f in log.fallbacks)
            finally:
                progress(length)

        checks = [check(r.rank, p, c) for r in manifest.ranks for p, c in enumerate(r.checksums)]
        report.parts = len(checks)
        await asyncio.gather(*checks)
        reports.append(report)
    return reports
