"""The Index protocol.

Lifecycle of one checkpoint (job, step): `begin` records the tiers a save targets (the checkpoint is now
listed, incomplete); rank 0 stores the manifest and every rank its part checksums (`put_rank_meta`);
each rank calls `mark_durable(tier, rank, world, session)` once its parts are durable on that tier, and
the call that completes the set of ranks of this session commits the tier (returns True). A session is one
opening of the engines of a job (agreed by all ranks), so markers left by a crashed earlier attempt at the
same step never count towards a new attempt. `mark_failed` records a rank's failure on a tier; the other
ranks see it through `tier_state` (a rank polling its commit passes its `rank`: an index may then report
that rank alone in `ranks_done`, so that a poll costs the same at any world size); `mark_skipped` records that a rank skipped a tier for this save because a
newer save superseded it there (not a failure: every rank then skips the tier too). `abandon` ends a session's commit
of a tier as failed unless it is complete, atomically with the markers (the node agent, before it gives up a
save). Retention calls `unmark` before it deletes a tier's data, so a crash
mid-delete never leaves a "complete" entry with missing parts. Removing a checkpoint everywhere first
`bury`s it: a tombstone that stays until its data is gone from every tier (`unbury`), so the tiers'
manifests can never bring a retired checkpoint back, and the next writer finishes a deletion a crash cut
short (`buried`).

Rank 0's `begin` also records the checkpoint's size, the `metadata` given to save() and its session's folder on
the tiers (`info`), so that `list()` reports them without reading a manifest (plain msgpack values: {"nbytes":
int, "metadata": dict, "folder": str}; an index passes the mapping through as given, and `folder` is absent
from saves of earlier releases).

A writer also keeps small notes for itself (`put_note`, `get_note`: bytes under a name, per job; a note is
written under the writer's fence, like every other write): retention keeps there, per tier, where its passes
left off, so a new process's first pass judges the window a steady pass does instead of the whole history
(lifecycle/retention_note.py). A note is a hint, never the truth: an index that lost it (a Redis restarted
empty) or never kept one (a third party's, without these methods) only costs the next writer one full pass.

`fence` starts a new incarnation of the job (the writer's first save); with `lease` (an engine opened with
`role = "writer"`) it also takes the job's writer lease, and a live writer holding it is a `WriterConflict`
naming it (the file index's lease is always taken: its lock). `attach` lets a cleaner (`tiered-ckpt
gc`, `tiered-ckpt delete`) change the index within the current incarnation instead, so a trainer that is
still running is not fenced out. It returns True when no writer of the job can run meanwhile (the file
index's writer lease was free and, with `hold`, is now held until `detach` or `close`; without, it was
only tested), False when one may be running (the lease is held elsewhere, or the index cannot tell, as
with Redis). `detach` releases what `attach` holds, once the cleaner is done.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Mapping, Protocol, Sequence

from ...errors import IncompleteCheckpoint

@dataclass(frozen=True)
class CheckpointStatus:
    """One checkpoint as the index (or, when the index forgot it, the tiers) knows it: where it was meant to
    go, where it is complete, what failed or was skipped, its size and metadata."""

    step: int
    tiers: tuple[str, ...]  # tiers the save targeted, fastest first
    complete: frozenset[str] = frozenset()
    failed: dict[str, str] = field(default_factory=dict)  # tier → "rank r: reason"
    created: float = 0.0
    foreign: str | None = None  # found on the tiers, committed to another index (its identity)
    incarnation: str | None = None  # found on the tiers: the folder holding it (None: the index knows)
    nbytes: int | None = None  # the checkpoint's size (one copy, every rank's parts); None: not recorded
    metadata: dict[str, Any] = field(default_factory=dict)  # what save(metadata=...) was given
    skipped: dict[str, int] = field(default_factory=dict)  # tiers that could not keep up → the step that superseded it
    folder: str | None = None  # the tiers' folder of the save that began it last (rank 0's begin); None: not recorded

    @property
    def is_complete(self) -> bool:
        """Whether some tier holds it complete (it can be loaded)."""
        return bool(self.complete)

    @property
    def settled(self) -> frozenset[str]:
        """Tiers on which no save of this checkpoint is still writing: complete, failed or skipped."""
        return self.complete | frozenset(self.failed) | frozenset(self.skipped)

    @property
    def incomplete(self) -> tuple[str, ...]:
        """Targeted tiers where it is not complete (yet, or any more), fastest first."""
        return tuple(t for t in self.tiers if t not in self.complete)


class CommitState(StrEnum):
    """Where a tier's commit of one save session stands (a str: an index may hand back the plain word)."""

    COMPLETE = "complete"  # every rank marked the tier durable
    FAILED = "failed"  # a rank recorded a failure (TierState.reason names it)
    SKIPPED = "skipped"  # a rank skipped the tier: a newer save superseded this one (TierState.newer)
    PENDING = "pending"  # none of these yet


@dataclass(frozen=True)
class TierState:
    """A tier's commit state for one save session: `state`, with why it failed (`reason` names the rank) or
    which step superseded it (`newer`), and the ranks that marked it durable so far."""

    state: CommitState
    reason: str = ""
    ranks_done: frozenset[int] = frozenset()
    newer: int | None = None
    forgotten: bool = False  # the index has no record of the checkpoint's begin any more (a Redis restarted empty)

    def __post_init__(self) -> None:
        object.__setattr__(self, "state", CommitState(self.state))  # an unknown word fails here, naming it


class Index(Protocol):
    identity: str  # which index this is (no credentials): manifests record it, tier fallback checks it
    epoch: int

    async def open(self) -> None: ...
    async def close(self) -> None: ...
    async def fence(self, job: str, *, lease: bool = False) -> int: ...
    async def attach(self, job: str, *, hold: bool = True) -> bool: ...
    async def detach(self, job: str) -> None: ...
    async def begin(self, job: str, step: int, tiers: Sequence[str], info: Mapping[str, Any] | None = None) -> None: ...
    async def put_manifest(self, job: str, step: int, data: bytes) -> None: ...
    async def get_manifest(self, job: str, step: int) -> bytes: ...
    async def put_rank_meta(self, job: str, step: int, rank: int, data: bytes) -> None: ...
    async def get_rank_meta(self, job: str, step: int, rank: int) -> bytes: ...
    async def get_rank_metas(self, job: str, step: int, ranks: Sequence[int]) -> dict[int, bytes]:
        """The checksum records of `ranks`, in as few calls to the store as it allows (a load reads every saved
        rank's: thousands); a rank the index holds no record of is absent. This default asks one rank at a
        time: an index that can do better overrides it (`rank_metas` serves indexes that lack it)."""
        return await _rank_metas_one_by_one(self, job, step, ranks)
    async def mark_durable(self, job: str, step: int, tier: str, rank: int, world_size: int, session: str) -> bool: ...
    async def mark_failed(self, job: str, step: int, tier: str, rank: int, session: str, reason: str) -> None: ...
    async def mark_skipped(self, job: str, step: int, tier: str, rank: int, session: str, newer: int) -> None: ...
    async def tier_state(self, job: str, step: int, tier: str, session: str, *,
                         rank: int | None = None) -> TierState: ...
    async def abandon(self, job: str, step: int, tier: str, session: str, rank: int, reason: str) -> bool:
        """End `session`'s commit of `tier` for `step` as failed (`reason`, recorded as `rank`'s failure), unless
        the tier is complete already: True when recorded, and from then on no marker of that session completes the
        tier (`mark_durable` raises RankFailed naming the reason); False when the tier was complete first. Atomic
        with the markers. The node agent calls it before it gives up a save it waited for (save/drain.py): a
        marker sent by a trainer that was killed, landing late, cannot then make the step whole on a tier whose
        drain nobody does. This default records nothing and says so (`abandon_commit` serves indexes without it)."""
        raise NotImplementedError(f"index {self.identity} cannot end a commit")
    async def unmark(self, job: str, step: int, tier: str) -> None: ...
    async def list(self, job: str) -> list[CheckpointStatus]: ...
    async def list_range(self, job: str, first: int = 0, *, newest: int | None = None, oldest: int | None = None,
                         also: Sequence[int] = ()) -> list[CheckpointStatus]:
        """The checkpoints of step >= `first` (with `newest`, only that many of the newest of them; with `oldest`,
        that many of the oldest of them, from `first` on), plus those of `also` that exist, oldest first, as
        `list` reports them. A save's retention and a load's pick ask this for the few steps they judge, so their
        cost does not grow with the history a job keeps: an index answers from an ordered structure (a sorted
        set, sorted folder names), from either end. This default filters `list` (`listing_range` serves indexes
        that lack it)."""
        return _filtered(await self.list(job), first, newest, also, oldest)
    async def steps(self, job: str) -> list[int]:
        """The steps the index holds a record of (listed or not: one whose begin never landed too), in order: a
        writer compares them with a tier's step folders to find what the index forgot, without decoding ten
        thousand records. This default takes them from `list` (`step_numbers` serves indexes that lack it)."""
        return [s.step for s in await self.list(job)]
    async def get_note(self, job: str, name: str) -> bytes | None:
        """The note `name` of `job` (see the module's docstring), or None when there is none. This default keeps
        none (`read_note` serves indexes that lack it)."""
        return None
    async def put_note(self, job: str, name: str, data: bytes) -> None:
        """Keep `data` as the note `name` of `job`, replacing the one there (fenced like any write). This default
        keeps nothing: the next writer then judges the whole history once."""
        return None
    async def jobs(self) -> list[str]: ...  # the jobs that have checkpoints here (for "no such job" messages)
    async def delete(self, job: str, step: int) -> None: ...
    async def bury(self, job: str, step: int) -> None: ...
    async def buried(self, job: str) -> set[int]: ...
    async def unbury(self, job: str, step: int) -> None: ...
    async def now(self) -> float:
        """The index's clock (Unix seconds), the one `CheckpointStatus.created` is read on: gc and delete judge
        a save's age by it, never by their own machine's clock against the trainer's."""
        ...
    async def began_under_writer(self, job: str, steps: Sequence[int]) -> set[int]:
        """Of `steps`, those begun while the job's live writer held its lease (it may be writing them now, however
        old their `created` looks: the file index stamps it with the writer's clock); empty when no live writer
        is known or the index's own clock stamps every save (Redis)."""
        ...


async def rank_metas(index: Index, job: str, step: int, ranks: Sequence[int]) -> dict[int, bytes]:
    """`index.get_rank_metas`, or for an index written before it existed (a third party's, not subclassing
    Index) one `get_rank_meta` per rank."""
    batched = getattr(index, "get_rank_metas", None)
    if batched is None:
        return await _rank_metas_one_by_one(index, job, step, ranks)
    return await batched(job, step, ranks)


async def _rank_metas_one_by_one(index: Index, job: str, step: int, ranks: Sequence[int]) -> dict[int, bytes]:
    found: dict[int, bytes] = {}
    for rank in ranks:
        try:
            found[rank] = await index.get_rank_meta(job, step, rank)
        except IncompleteCheckpoint:
            continue  # no record: absent (an unreachable index raises, as for one record)
    return found


async def listing_range(index: Index, job: str, first: int = 0, *, newest: int | None = None,
                        oldest: int | None = None, also: Sequence[int] = ()) -> list[CheckpointStatus]:
    """`index.list_range`, or for an index written before it existed (a third party's, not subclassing Index)
    `list` filtered the same way (also where its `list_range` predates `oldest`)."""
    ranged = getattr(index, "list_range", None)
    if ranged is None or (oldest is not None and "oldest" not in inspect.signature(ranged).parameters):
        return _filtered(await index.list(job), first, newest, also, oldest)
    if oldest is None:
        return await ranged(job, first, newest=newest, also=also)
    return await ranged(job, first, newest=newest, oldest=oldest, also=also)


async def abandon_commit(index: Index, job: str, step: int, tier: str, session: str, rank: int,
                         reason: str) -> bool | None:
    """`index.abandon`; None for an index without it (a third party's, or one written before it existed)."""
    abandon = getattr(index, "abandon", None)
    if abandon is None:
        return None
    try:
        return bool(await abandon(job, step, tier, session, rank, reason))
    except NotImplementedError:
        return None


async def read_note(index: Index, job: str, name: str) -> bytes | None:
    """`index.get_note`, or None for an index written before it existed (a third party's)."""
    get = getattr(index, "get_note", None)
    return None if get is None else await get(job, name)


async def write_note(index: Index, job: str, name: str, data: bytes) -> None:
    """`index.put_note`; nothing for an index written before it existed."""
    put = getattr(index, "put_note", None)
    if put is not None:
        await put(job, name, data)


async def step_numbers(index: Index, job: str) -> list[int]:
    """`index.steps`, or for an index written before it existed the steps of its `list`."""
    steps = getattr(index, "steps", None)
    if steps is None:
        return [s.step for s in await index.list(job)]
    return await steps(job)


async def status_of(index: Index, job: str, step: int) -> CheckpointStatus | None:
    """Checkpoint `step` as `list` reports it, or None: one step asked for by name, whatever the history."""
    found = await listing_range(index, job, NO_STEP, also=[step])
    return next((s for s in found if s.step == step), None)


NO_STEP = 1 << 62  # a `first` above every step: list_range then lists only the steps asked for by name


def _filtered(statuses: list[CheckpointStatus], first: int, newest: int | None,
              also: Sequence[int], oldest: int | None = None) -> list[CheckpointStatus]:
    window = [s for s in statuses if s.step >= first]
    if newest is not None:
        window = window[len(window) - newest:] if 0 < newest < len(window) else ([] if newest <= 0 else window)
    if oldest is not None:
        window = window[:max(oldest, 0)]
    steps = {s.step for s in window} | set(also)
    return [s for s in statuses if s.step in steps]
