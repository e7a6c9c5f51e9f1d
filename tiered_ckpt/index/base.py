"""The Index protocol.

Lifecycle of one checkpoint (job, step): `begin` records the tiers a save targets (the checkpoint is now
listed, incomplete); `put_manifest` stores the manifest; each rank calls `mark_durable(tier, rank, world)`
once its parts and the manifest are durable on that tier, and the call that completes the set commits the
tier (returns True). `mark_failed` records a tier that will never complete. Retention calls `unmark`
before it deletes a tier's data, so a crash mid-delete never leaves a "complete" entry with missing parts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence


@dataclass(frozen=True)
class CheckpointStatus:
    step: int
    tiers: tuple[str, ...]  # tiers the save targeted, fastest first
    complete: frozenset[str] = frozenset()
    failed: dict[str, str] = field(default_factory=dict)
    created: float = 0.0

    @property
    def is_complete(self) -> bool:
        return bool(self.complete)

    @property
    def incomplete(self) -> tuple[str, ...]:
        return tuple(t for t in self.tiers if t not in self.complete)


class Index(Protocol):
    async def open(self) -> None: ...
    async def close(self) -> None: ...
    async def begin(self, job: str, step: int, tiers: Sequence[str]) -> None: ...
    async def put_manifest(self, job: str, step: int, data: bytes) -> None: ...
    async def get_manifest(self, job: str, step: int) -> bytes: ...
    async def mark_durable(self, job: str, step: int, tier: str, rank: int, world_size: int) -> bool: ...
    async def mark_failed(self, job: str, step: int, tier: str, reason: str) -> None: ...
    async def unmark(self, job: str, step: int, tier: str) -> None: ...
    async def list(self, job: str) -> list[CheckpointStatus]: ...
    async def delete(self, job: str, step: int) -> None: ...
