"""Re-read every part of a checkpoint on every tier that holds it and check length and crc32c."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable

from .checksum import checksum
from .engine import Engine
from .errors import TierError
from .tiers.base import PartKey


@dataclass
class TierReport:
    tier: str
    complete: bool
    parts: int = 0
    bad: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.bad


async def verify(engine: Engine, step: int, progress: Callable[[int], None] = lambda n: None) -> list[TierReport]:
    """One report per tier the checkpoint targets (complete or not)."""
    status = await engine.status(step)
    if status is None:
        raise LookupError(f"job {engine.job!r} has no checkpoint {step}")
    tiers = [engine.tiers[n] for n in engine.tier_order(status.tiers)]
    manifest = await engine.read_manifest(step, tiers)
    reports = []
    for tier in tiers:
        report = TierReport(tier.name, tier.name in status.complete)

        async def check(rank: int, p: int, expected: int) -> None:
            key = PartKey(engine.job, step, rank, p).path
            length = manifest.part_length(rank, p)
            buf = memoryview(bytearray(length))
            try:
                n = await engine.pipelines[tier.name].submit(length, lambda: tier.read_into(key, [buf]), f"read {key}")
            except TierError as e:
                report.bad.append(f"{key}: {type(e).__name__}: {e}")
                return
            finally:
                progress(length)
            if n != length:
                report.bad.append(f"{key}: length {n}, expected {length}")
            elif (actual := await engine.run_blocking(checksum, [buf])) != expected:
                report.bad.append(f"{key}: crc32c {actual:#010x}, expected {expected:#010x}")

        checks = [check(r.rank, p, c) for r in manifest.ranks for p, c in enumerate(r.checksums)]
        report.parts = len(checks)
        await asyncio.gather(*checks)
        reports.append(report)
    return reports
