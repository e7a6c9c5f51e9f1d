"""A save's drain to its slower tiers, as data that crosses a process boundary, and the drain itself.

With `[engine] agent = "on"` and the staging buffer being the memory tier's files, the trainer commits the memory
tier itself, then hands the rest of the save to the node agent (agent/): everything the drain needs is in a
`DrainOrder` (the job, the step, the rank and the world, the session and its folder, the fencing token, each part's
key, length and checksums, this rank's records, the tiers as config tables) and the bytes are the memory tier's
committed copy, read back verified. The agent reports one `TierOutcome` per tier (settled: done, failed or
skipped) and the trainer resolves its SaveHandle from them. `drain_tier` is the agent's side: the save's turn on
the tier, then the one copy-then-commit (lifecycle/copy_commit.py) under the writer's fencing (the Redis index's
epoch; the file index's lease, whose descriptor the trainer passes along).
"""
from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, AsyncIterator, Protocol, Sequence

from ..errors import TierError
from ..layout import committed_key, manifest_key, rank_prefix
from ..lifecycle.copy_commit import CopyThenCommit, RankCopy
from ..storage.tier_io import TierIO
from ..storage.verified_read import PartRead, ReadLog
from .commit import Committer, Superseded

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DrainOrder:
    """One rank's save of one step, handed over for its slower tiers after the memory tier committed it: plain
    values only (msgpack). `link` is the job's side, the same for each save of an engine (index URL and timeouts,
    every tier's config table, this rank's node); the rest is the save's."""

    job: str
    step: int
    rank: int
    world_size: int
    session: str
    incarnation: str
    epoch: int  # the Redis index's fencing epoch of the writer (the file index has none: its lease travels)
    tiers: tuple[str, ...]  # the tiers to drain, fastest first
    source: str  # the tier that holds the committed copy (the memory tier)
    keys: tuple[str, ...]  # each part's key
    lengths: tuple[int, ...]
    sums: tuple[tuple[int, bytes], ...]  # each part's (checksum, chunk digests)
    algorithm: str
    chunk_size: int
    records: tuple[tuple[str, bytes], ...]  # (key, bytes): this rank's checksum record; rank 0's manifest too
    link: dict[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, raw: dict[str, Any]) -> "DrainOrder":
        raw = dict(raw)
        for name in ("tiers", "keys", "lengths"):
            raw[name] = tuple(raw[name])
        raw["sums"] = tuple((int(c), bytes(s)) for c, s in raw["sums"])
        raw["records"] = tuple((str(k), bytes(v)) for k, v in raw["records"])
        return cls(**raw)


@dataclass(frozen=True)
class TierOutcome:
    """How one tier of a handed-off save settled: "done" (committed), "failed" (`error`, recorded in the index
    for every rank) or "skipped" (a newer save, `newer`, superseded it there)."""

    tier: str
    state: str
    error: str = ""
    newer: int | None = None

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, raw: dict[str, Any]) -> "TierOutcome":
        return cls(**raw)


class Drain(Protocol):
    """A handed-off drain as the trainer sees it: each tier's outcome as it settles."""

    def outcomes(self) -> AsyncIterator[TierOutcome]: ...


class Drainer(Protocol):
    """Who drains a save for the trainer (the agent's client). `hand_off` returns once the drain is accepted;
    it raises (TierError) when nobody accepts it in time: the trainer then drains in-process."""

    async def hand_off(self, order: DrainOrder, fds: Sequence[int]) -> Drain: ...


class _CommittedCopy:
    """The parts of `order` read back from its source tier (the memory tier's committed copy), verified."""

    def __init__(self, io: TierIO, order: DrainOrder):
        self.io, self.order = io, order

    @asynccontextmanager
    async def part(self, p: int) -> AsyncIterator[memoryview]:
        order = self.order
        length = order.lengths[p]
        buf = bytearray(length)
        checksum, chunk_sums = order.sums[p]
        part = PartRead(order.keys[p], [memoryview(buf)], length, checksum, algorithm=order.algorithm,
                        chunk_size=order.chunk_size if chunk_sums else 0, chunk_sums=chunk_sums)
        await self.io.read_verified(part, [order.source], ReadLog(), budgeted=False)
        yield memoryview(buf)


async def drain_tier(io: TierIO, commit: Committer, order: DrainOrder, tier: str) -> TierOutcome:
    """`order`'s copy onto `tier`: the save's turn there (a newer save supersedes a waiting one), the parts, the
    records, the check, this rank's durable marker and the commit wait, then rank 0's committed marker. A failure
    is recorded in the index (every rank's wait sees it) and the parts written are taken back."""
    turns = io.turns(tier)
    newer = await turns.take(order.step)
    if newer is not None:
        await commit.skip_tier(order.step, tier, newer)
        return TierOutcome(tier, "skipped", newer=newer)
    marked = False
    give_turn = turns.give_once()

    async def committed() -> None:
        nonlocal marked
        await commit.mark_durable(order.step, tier)
        marked = True
        await commit.wait_complete(order.step, tier)
        if order.rank == 0:
            try:
                await io.write(tier, committed_key(order.job, order.step, order.incarnation), memoryview(b""))
            except TierError as e:
                log.warning("step %d is committed on tier %s, but its marker there was not written: %s",
                            order.step, tier, e)

    async def records() -> Sequence[tuple[str, bytes]]:
        return order.records

    copy = CopyThenCommit(io, RankCopy(tier, order.step, order.rank, order.keys, order.lengths),
                          _CommittedCopy(io, order), records, committed, after_records=give_turn)
    try:
        newer = await commit.skipped(order.step, tier)
        if newer is not None:
            return TierOutcome(tier, "skipped", newer=newer)
        await copy.run()
    except Superseded as e:
        return TierOutcome(tier, "skipped", newer=e.newer)
    except Exception as e:
        error = await commit.fail_tier(order.step, tier, e)
        if not marked:
            await _take_back(io, order, tier)
        return TierOutcome(tier, "failed", error=f"{type(error).__name__}: {error}")
    finally:
        give_turn()
    return TierOutcome(tier, "done")


async def _take_back(io: TierIO, order: DrainOrder, tier: str) -> None:
    """A failed drain gives back the room its parts took (as a failed in-process save does: tier_write)."""
    keys = [rank_prefix(order.job, order.step, order.rank, order.incarnation)]
    if order.rank == 0:
        keys.append(manifest_key(order.job, order.step, order.incarnation))
    for key in keys:
        try:
            await io.delete(tier, key)
        except TierError as e:
            log.warning("step %d failed on tier %s and its parts could not be removed: %s", order.step, tier, e)
