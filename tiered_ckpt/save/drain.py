"""A save's drain to its slower tiers, as data that crosses a process boundary, and the drain itself.

With `[engine] agent = "on"` and the staging buffer being the memory tier's files, the trainer hands the rest of the
save to the node agent (agent/) once its parts and records are on the memory tier, then commits that tier itself;
the agent drains once the index says the memory tier committed (`wait_for_source`), and abandons the order when it
never does (so a trainer killed at any moment after that commit still gets every tier, and one killed before it
leaves nothing that looks whole). Everything the drain needs is in a
`DrainOrder` (the job, the step, the rank and the world, the session and its folder, the fencing token, each part's
key, length and checksums, this rank's records, the tiers as config tables) and the bytes are the memory tier's
committed copy, read back verified. The agent reports one `TierOutcome` per tier (settled: done, failed, abandoned or
skipped) and the trainer resolves its SaveHandle from them. `drain_tier` is the agent's side: the save's turn on
the tier, then the one copy-then-commit (lifecycle/copy_commit.py) under the writer's fencing (the Redis index's
epoch; the file index's lease, whose descriptor the trainer passes along).
"""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field, fields
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol, Sequence

from ..errors import Fenced, IndexUnavailable, TierError, TieredCkptError, TierFull
from ..layout import committed_key, manifest_key, rank_prefix
from ..lifecycle.copy_commit import CopyThenCommit, RankCopy
from ..storage.index import CommitState
from ..storage.index.base import abandon_commit
from ..storage.tier_io import TierIO
from ..storage.verified_read import PartRead, ReadLog
from .commit import Committer, Superseded

log = logging.getLogger(__name__)
GONE_GRACE = 1.0  # seconds a drain still waits for the trainer's durable marker after its trainer went


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
        """The fields as they are (msgpack takes the tuples and bytes): `asdict` deep-copied every part's key,
        length and checksums on the trainer's event loop (~2 ms per save of 72 tensors, docs/benchmarks.md)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

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
    for every rank), "skipped" (a newer save, `newer`, superseded it there), "abandoned" (the memory tier never
    committed the save, `error` says why: nothing was written; a trainer still there writes the tier itself) or
    "full" (the tier had no room: nothing recorded, the parts taken back; the trainer, whose retention can retire
    older checkpoints there, writes the tier itself)."""

    tier: str
    state: str
    error: str = ""
    newer: int | None = None
    kind: str = ""  # the failure's class (errors.py), so the trainer raises the same one: TierFull, TierNotFound...

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


async def wait_for_source(commit: Committer, order: DrainOrder, trainer_gone: Callable[[], bool],
                          timeout: float, superseded: Callable[[], bool] = lambda: False) -> str | None:
    """Wait until the index says `order`'s source tier (the memory tier) committed the step: None then, else why it
    never will (the tier failed or was skipped, the trainer is gone without having marked its copy durable, or
    `timeout` passed, or `superseded()`: a newer engine of the job opened, so the session's commit is over). The
    trainer hands a save over before that commit, so that no moment after it finds the slower
    tiers in nobody's hands; what it hands over before the commit must not be drained unless the commit happens.

    Before it gives up, the session's commit on the source tier is ended in the index (`end_source_commit`),
    atomically with the ranks' markers: a marker that lands later (sent by a trainer as it was killed, held up in a
    slow index) is refused, and one that landed first means the tier committed: the order is drained after all.
    AbandonNotRecorded: the index took no such record (unreachable): the order must stay on file for a later try."""
    why = await _wait_for_source(commit, order, trainer_gone, timeout, superseded)
    return None if why is None else await end_source_commit(commit, order, why)


class AbandonNotRecorded(Exception):
    """The index did not take the end of the memory tier's commit: a late marker could still complete it."""


async def end_source_commit(commit: Committer, order: DrainOrder, why: str) -> str | None:
    """Record that `order`'s session will not commit its source tier (`why`), unless it did: then None (drain)."""
    try:
        recorded = await abandon_commit(commit.index, order.job, order.step, order.source, order.session,
                                        order.rank, f"abandoned by the node agent: {why}")
    except Fenced:  # a newer writer fenced the session: its late markers are refused as well
        return why
    except (TieredCkptError, OSError) as e:
        raise AbandonNotRecorded(f"{why}; and the index did not record that (so a marker landing late could still "
                                 f"commit tier {order.source}): {type(e).__name__}: {e}") from None
    if recorded is False:
        log.info("step %d: tier %s committed just before the agent gave it up (%s): drained", order.step,
                 order.source, why)
        return None
    return why


async def _wait_for_source(commit: Committer, order: DrainOrder, trainer_gone: Callable[[], bool],
                           timeout: float, superseded: Callable[[], bool]) -> str | None:
    step, source = order.step, order.source
    deadline = time.monotonic() + timeout
    delay = 0.005
    gone_since: float | None = None
    while True:
        gone = trainer_gone()  # read before the poll: a marker the trainer wrote before it went is seen
        if gone and gone_since is None:
            gone_since = time.monotonic()
        try:
            state = await commit.index.tier_state(order.job, step, source, order.session, **commit.poll_as)
        except IndexUnavailable as e:
            if time.monotonic() > deadline:
                return f"the index did not say whether tier {source} committed step {step}: {e}"
        else:
            if state.state == CommitState.COMPLETE:
                return None
            if state.state == CommitState.FAILED:
                return f"tier {source} failed step {step}: {state.reason}"
            if state.state == CommitState.SKIPPED:
                return f"tier {source} skipped step {step}"
            if state.forgotten:
                return f"the index forgot step {step}"
            if superseded():
                return f"a newer engine of job {order.job} opened before tier {source} committed step {step}"
            if (gone_since is not None and order.rank not in state.ranks_done
                    and time.monotonic() - gone_since >= GONE_GRACE):
                # (after a grace: a marker the trainer sent as it was killed still lands in the index)
                return f"the trainer went before it marked step {step} durable on tier {source}"
            if time.monotonic() > deadline:
                return f"tier {source} did not commit step {step} within {timeout:g}s"
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.1)


async def drain_tier(io: TierIO, commit: Committer, order: DrainOrder, tier: str,
                     hand_back: Callable[[], bool] = lambda: False,
                     make_room: Callable[[], Awaitable[bool]] | None = None) -> TierOutcome:
    """`order`'s copy onto `tier`: the save's turn there (a newer save supersedes a waiting one), the parts, the
    records, the check, this rank's durable marker and the commit wait, then rank 0's committed marker. A failure
    is recorded in the index (every rank's wait sees it) and the parts written are taken back. `make_room`: on a
    full tier, retire an older checkpoint there and write again (the agent's retention, once the trainer is gone).
    A tier still full before this rank marked its copy, while `hand_back()` (its trainer is attached), is "full":
    nothing recorded, the parts taken back, and the trainer, whose retention may retire older checkpoints there,
    writes the tier itself."""
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
                          _CommittedCopy(io, order), records, committed, make_room=make_room,
                          after_records=give_turn)
    try:
        newer = await commit.skipped(order.step, tier)
        if newer is not None:
            return TierOutcome(tier, "skipped", newer=newer)
        await copy.run()
    except Superseded as e:
        return TierOutcome(tier, "skipped", newer=e.newer)
    except TierFull as e:
        if marked or not hand_back():
            return await _failed(io, commit, order, tier, e, marked)
        await _take_back(io, order, tier)
        return TierOutcome(tier, "full", error=f"{type(e).__name__}: {e}", kind=type(e).__name__)
    except Exception as e:
        return await _failed(io, commit, order, tier, e, marked)
    finally:
        give_turn()
    return TierOutcome(tier, "done")


async def _failed(io: TierIO, commit: Committer, order: DrainOrder, tier: str, e: Exception,
                  marked: bool) -> TierOutcome:
    """Recorded in the index (every rank's wait sees it), and the room the parts took given back."""
    error = await commit.fail_tier(order.step, tier, e)
    if not marked:
        await _take_back(io, order, tier)
    return TierOutcome(tier, "failed", error=f"{type(error).__name__}: {error}", kind=type(error).__name__)


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
