"""The writer role: which process may change the index, and when it starts to.

An engine is a *reader* until its first save (or delete): listing, loading, verifying and exporting change
nothing in the index, so an evaluator or the CLI beside a running trainer can never fence it or delete its
saves in flight. At its first save (at open with `role = "writer"`) it becomes the job's *writer*: rank 0
fences earlier incarnations (the Redis epoch; the file index's lease; with `role = "writer"` also the Redis
index's writer lease, refused while a live writer holds it), every rank takes the new epoch, and rank 0 cleans what a crashed run
left (removals cut short, incomplete checkpoints newer than the newest complete one) and lists again the
committed checkpoints the index forgot (lifecycle/lineage.py). A *cleaner* (`gc`,
`tiered-ckpt delete`) attaches instead: it changes the index within the current incarnation, so a trainer
that is still running is not fenced out.
"""
from __future__ import annotations

import asyncio
import logging

from ..distributed.coordinator import Coordinator
from ..errors import IndexUnavailable, TierError, TierFull, TieredCkptError
from ..layout import probe_key
from ..storage.files import cannot_write
from ..storage.index import CheckpointStatus, Index, listing_range, read_note, write_note
from . import lineage
from .removal import Removal

log = logging.getLogger(__name__)


PROBE_TIMEOUT = 20.0  # seconds a writer's probe of one tier may take (no retries): well inside collective_timeout


FIRST_LOOK = 16  # the newest records a writer's start reads first; eight times more at each look further back


async def newest_through_complete(index: Index, job: str) -> list[CheckpointStatus]:
    """The index's newest checkpoints back to its newest complete one (all of them when none is complete), oldest
    first: what a crashed run may have left unfinished above the checkpoint a resumed run starts from. Read from
    the newest end, wider at each look, so it costs the few records a crash leaves, not the history."""
    count = FIRST_LOOK
    while True:
        recent = await listing_range(index, job, newest=count)
        if len(recent) < count or any(s.is_complete for s in recent):
            newest = max((s.step for s in recent if s.is_complete), default=None)
            return recent if newest is None else [s for s in recent if s.step >= newest]
        count *= 8


class Writer:
    def __init__(self, job: str, index: Index, coordinator: Coordinator, removal: Removal, *, lease: bool = False):
        self.job = job
        self.lease = lease  # role = "writer": hold the index's writer lease, refused beside a live holder
        self.index = index
        self.coordinator = coordinator
        self.removal = removal
        self.is_writer = False
        self.is_cleaner = False  # attach()ed: may delete within the current incarnation

    async def become(self) -> None:
        """Become the job's writer (collective: every rank calls it, at open with `role = "writer"`, else at
        its first save). Raises on every rank when rank 0 was refused (another writer holds the lease) or when a
        tier cannot be written at all (`probe`); an unreachable index leaves this engine a reader, and the save
        goes on to fail at its commit, naming the index."""
        if self.is_writer:
            return
        await self.coordinator.agree(await self._probe())

        async def fence() -> tuple[int, list[int]] | None:
            try:
                epoch = await self.index.fence(self.job, lease=self.lease)
            except IndexUnavailable as e:
                log.warning("%s: not the job's writer yet; the next save tries again", e)
                return None
            self.index.epoch = epoch
            return epoch, await self._clean_leftovers()

        # refused (WriterConflict, Fenced, AuthenticationError, ConfigError): rank 0 raises it, the others RankFailed
        fenced = await self.coordinator.on_first(fence, "becoming the job's writer")
        if fenced is not None:
            self.index.epoch, self.is_writer = fenced[0], True
            self.removal.committed.update(fenced[1])  # listed again: saving those steps over is refused
            self.removal.relisted.update(fenced[1])

    async def _probe(self) -> BaseException | None:
        """Write and remove a small value on each tier this rank answers for (its node's file tiers; rank 0 also
        the others), all at once, so that a tier that can never be written (a read-only or wrong path, a refused
        login) fails the writer's start in one line instead of every save in the background. A tier that is only
        unreachable now (retryable) is a warning: it may be back by the time a save reaches it."""
        io, rank = self.removal.io, self.coordinator.rank
        answers = [t for t in io.names if rank == 0 or (io.file_tier(t) is not None and self.coordinator.lists_for_node())]
        key = probe_key(self.job, self.coordinator.session, rank)

        async def probe(tier: str) -> BaseException | None:  # never raises: every rank must reach agree()
            try:
                await io.probe(tier, key, PROBE_TIMEOUT)
            except TierFull:
                return None  # full now: retention makes room for a save, not for a probe
            except TierError as e:
                if e.retryable:  # unreachable or slow now (a timeout too): not a reason to refuse the writer
                    log.warning("tier %s cannot be reached now (%s); saves will try it", tier, e)
                    return None
                return TierError(f"this process cannot write tier {tier!r} ({e}); nothing was saved", tier=tier)
            except Exception as e:
                return TierError(f"this process cannot write tier {tier!r} ({type(e).__name__}: {e}); nothing was "
                                 f"saved", tier=tier)
            return None

        failed = [e for e in await asyncio.gather(*map(probe, answers)) if e is not None]
        return failed[0] if failed else None

    async def warn_unwritable(self) -> None:
        """At open with `role = "auto"`: a warning naming each file tier this rank answers for (its node's; rank 0
        also the shared ones) that it plainly cannot write, so a wrong path is known before the first save
        fails on it. Why not `_probe`: an "auto" engine may only ever read (an evaluator, beside the trainer)
        and then writes nothing, not even a probe, on the tiers (readers' promise: docs/operations.md, *Readers
        and writers*); on a read-only copy it must still open. So this writes nothing: it looks at the folder
        (read-only file system, permissions, a file in the way; storage/files.cannot_write), and says nothing of
        what only a write shows (/proc as root, an S3 or Redis tier's permissions): the first save does."""
        io, rank, c = self.removal.io, self.coordinator.rank, self.coordinator
        key = probe_key(self.job, c.session, rank)

        def reasons() -> list[tuple[str, str]]:
            out = []
            for name in io.names:
                tier = io.file_tier(name)
                if tier is None or not (rank == 0 or c.lists_for_node()):
                    continue
                why = cannot_write(tier.path_of(key).parent)
                if why is not None:
                    out.append((name, why))
            return out

        for name, why in await asyncio.to_thread(reasons):
            log.warning("tier %r cannot be written by this process (%s): every save will fail there; an engine "
                        "that only reads says so with [engine] role = \"reader\" (no warning), a trainer with "
                        "role = \"writer\" (checked by a probe write at open)", name, why)

    async def _clean_leftovers(self) -> list[int]:
        """Finish removals a crash cut short, list again what the index forgot (returned), and remove incomplete
        checkpoints newer than the newest complete one (a crashed run's, which this run would save over). None of
        it reads the whole history: the index's newest records back to its newest complete one; where the index
        holds the note an earlier writer's start left (`lineage.NOTE`: it kept its history since), the tiers'
        steps from that newest complete one on (what a restore from an older snapshot left out); where it holds
        none (a Redis restarted empty, the first start, an index that keeps no notes) or retention found since that
        the index forgot steps it had listed, its step numbers against each tier's step folders, all of them
        (lifecycle/lineage.relist)."""
        relisted: list[int] = []
        try:
            await self.removal.finish_burials()
            recent = await newest_through_complete(self.index, self.job)
            kept = await read_note(self.index, self.job, lineage.NOTE) == lineage.KEPT
            since = min((s.step for s in recent if s.is_complete), default=None) if kept else None
            missed: list[str] = []
            relisted = await lineage.relist(self.removal.io, self.index, self.job, self.coordinator.session,
                                            since=since, missed=missed)
            if not kept and not missed:  # (a tier not listed: the next start compares everything again)
                await write_note(self.index, self.job, lineage.NOTE, lineage.KEPT)
            complete = [s.step for s in recent if s.is_complete] + relisted  # (relisted: complete, on known tiers)
            unknown = {t for s in recent for t in s.tiers} - set(self.removal.io.names)
            if unknown:
                log.warning("job %r: the index lists checkpoints on tier(s) %s, which this config does not have (a "
                            "tier renamed or removed?): retention and gc leave their copies on this config's tiers "
                            "alone; a tier renamed is read again under its earlier name", self.job,
                            ", ".join(sorted(unknown)))
            await self.removal.drop_incomplete_after(max(complete, default=-1), recent)
        except (TieredCkptError, OSError) as e:  # cleaning up must never fail a save
            log.warning("leftovers of an earlier run were not removed: %s: %s", type(e).__name__, e)
        return relisted

    async def attach(self, *, hold: bool = True) -> bool:
        """Become a cleaner of the job without starting a new incarnation: delete and gc then change the index
        within the current one. True when no writer of the job can run meanwhile: this engine is the writer,
        or the file index's writer lease was free (with `hold`, it is held until detach()). False when one may
        be running (the lease is held elsewhere; with Redis, always)."""
        if self.is_writer:
            return True
        exclusive = await self.index.attach(self.job, hold=hold)
        self.is_cleaner = self.is_cleaner or hold
        return exclusive

    async def detach(self) -> None:
        """The cleaning is done: release what attach() holds. A writer keeps its lease."""
        if self.is_cleaner and not self.is_writer:
            self.is_cleaner = False
            await self.index.detach(self.job)

    @property
    def may_delete(self) -> bool:
        return self.is_writer or self.is_cleaner
