"""One rank's copy onto one tier, then its commit: the one way a rank's parts reach a tier after the staging copy.

The save's write to each tier (save/tier_write.py), a heal's copy of a rank a cache lost (load/heal.py) and the
node agent's drain (agent/) all run it, in this order: every part, this rank's records (its checksum record;
rank 0's manifest), the check that nothing written vanished (a cache that restarted empty mid-copy), then the
commit the caller names (the save's durable marker and commit wait; a heal's manifest and committed marker). A
copy cut short never looks whole: the records come after the parts and the commit after both.

What the copy needs is plain values (`RankCopy`: the tier, the step, the rank, each part's key and length), so a
copy handed to another process (the agent) is described by data alone; the bytes come from a `PartBytes` (the
save's staging buffer, a tier that holds the parts) and the records and the commit from callables.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import AsyncContextManager, Awaitable, Callable, Protocol, Sequence

from ..errors import TierFull, TierNotFound
from ..storage.tier_io import TierIO
from . import fault_points


@dataclass(frozen=True)
class RankCopy:
    """One rank's copy of one step onto one tier, as data: each part's key and length, in part order."""

    tier: str
    step: int
    rank: int
    keys: tuple[str, ...]
    lengths: tuple[int, ...]


class PartBytes(Protocol):
    """Where a copy reads a part's bytes: lent for as long as the context lasts."""

    def part(self, p: int) -> AsyncContextManager[memoryview]: ...


Hook = Callable[[], Awaitable[None]]


@dataclass
class CopyThenCommit:
    """Copy `copy`'s parts from `source` onto its tier through `io`, write `records()`, check, then `commit()`.

    `lend_per_attempt`: each write attempt borrows the part anew (the save: a retry after the staging buffer went
    back reads it from wherever it is then); else the part is read once and then written (a heal: a read that
    fails is the source's failure, not the write's). `concurrent`: every part at once, bounded by the tier's
    budget (the save), else one after the other (a heal, which holds each part in memory of its own).
    `make_room`: on a tier full of older checkpoints, retire some and write the parts that did not fit again
    (returns False when nothing is left to retire). `settled(p, ok)`: part p is done on the tier (ok: held).
    `before_records`: a check between the parts and the records (a heal: the checkpoint is still listed);
    `after_records`: the tier is no longer needed for writing (the save passes its turn on). `written` lists
    the keys this copy wrote, or was writing, in order: what a caller takes back when it fails."""

    io: TierIO
    copy: RankCopy
    source: PartBytes
    records: Callable[[], Awaitable[Sequence[tuple[str, bytes]]]]
    commit: Hook
    what: str = "write"
    lend_per_attempt: bool = True
    concurrent: bool = True
    make_room: Callable[[], Awaitable[bool]] | None = None
    settled: Callable[[int, bool], None] | None = None
    before_records: Hook | None = None
    after_records: Callable[[], None] | None = None
    written: list[str] = field(default_factory=list)

    async def run(self, *, parts_present: bool = False) -> None:
        """The whole copy and its commit. `parts_present`: the parts are on the tier already (the memory tier
        whose files the staging buffer was: published by a rename), only the records and the commit remain."""
        if not parts_present:
            await (self._parts_concurrently() if self.concurrent else self._parts_in_turn())
        if self.before_records is not None:
            await self.before_records()
        blobs = await self.records()
        for key, data in blobs:
            self.written.append(key)
            await self.io.write(self.copy.tier, key, memoryview(data))
        if self.after_records is not None:
            self.after_records()
        fault_points.reached(f"records-written:{self.copy.tier}", self.copy.step)
        await self.check([*self.copy.keys, *(key for key, _ in blobs)])
        await self.commit()
        fault_points.reached(f"committed:{self.copy.tier}", self.copy.step)

    async def check(self, keys: Sequence[str]) -> None:
        """Nothing written may have vanished before the commit (e.g. a cache that restarted empty mid-copy)."""
        gone = await self.io.missing(self.copy.tier, keys)
        if gone:
            raise TierNotFound(f"step {self.copy.step}: {len(gone)} value(s) vanished before the commit, first "
                               f"{gone[0]}", tier=self.copy.tier)

    def _what(self, p: int) -> str:
        return f"{self.what} part {p} of rank {self.copy.rank}, step {self.copy.step}"

    async def _write_part(self, p: int) -> None:
        tier, key, length = self.copy.tier, self.copy.keys[p], self.copy.lengths[p]
        if self.lend_per_attempt:
            await self.io.write_from(tier, key, length, lambda: self.source.part(p), self._what(p))
        else:
            async with self.source.part(p) as data:
                await self.io.write(tier, key, data, self._what(p))
        fault_points.reached(f"part-written:{tier}", self.copy.step)

    async def _parts_in_turn(self) -> None:
        for p, key in enumerate(self.copy.keys):
            self.written.append(key)
            try:
                await self._write_part(p)
            except BaseException:
                self._settle(p, False)
                raise
            self._settle(p, True)

    async def _parts_concurrently(self) -> None:
        """Every part at once; on a full tier, `make_room` retires the tier's oldest checkpoint (never the newest
        complete one) and the parts that did not fit are written again, until they fit or nothing is left."""
        todo = list(range(len(self.copy.keys)))
        self.written.extend(self.copy.keys)
        while True:
            results = await asyncio.gather(*(self._write_part(p) for p in todo), return_exceptions=True)
            failed = [(p, r) for p, r in zip(todo, results) if isinstance(r, BaseException)]
            for p, r in zip(todo, results):
                if not isinstance(r, BaseException):
                    self._settle(p, True)
            full = bool(failed) and all(isinstance(r, TierFull) for _, r in failed)
            if full and self.make_room is not None and await self.make_room():
                todo = [p for p, _ in failed]
                continue
            for p, _ in failed:
                self._settle(p, False)
            if failed:
                raise failed[0][1]
            return

    def _settle(self, p: int, ok: bool) -> None:
        if self.settled is not None:
            self.settled(p, ok)
