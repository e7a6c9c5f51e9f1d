"""The writer role: which process may change the index, and when it starts to.

An engine is a *reader* until its first save (or delete): listing, loading, verifying and exporting change
nothing in the index, so an evaluator or the CLI beside a running trainer can never fence it or delete its
saves in flight. At its first save it becomes the job's *writer*: rank 0 fences earlier incarnations (the
Redis epoch; the file index's lease), every rank takes the new epoch, and rank 0 cleans what a crashed run
left (removals cut short, incomplete checkpoints newer than the newest complete one) and lists again the
committed checkpoints the index forgot (lifecycle/lineage.py). A *cleaner* (`gc`,
`tiered-ckpt delete`) attaches instead: it changes the index within the current incarnation, so a trainer
that is still running is not fenced out.
"""
from __future__ import annotations

import logging
from typing import Any

from ..distributed.coordinator import Coordinator
from ..errors import IndexUnavailable, RankFailed, TieredCkptError
from ..storage.index import Index
from . import lineage
from .removal import Removal

log = logging.getLogger(__name__)


class Writer:
    def __init__(self, job: str, index: Index, coordinator: Coordinator, removal: Removal):
        self.job = job
        self.index = index
        self.coordinator = coordinator
        self.removal = removal
        self.is_writer = False
        self.is_cleaner = False  # attach()ed: may delete within the current incarnation

    async def become(self) -> None:
        """Become the job's writer (collective: every rank calls it, at its first save). Raises on every rank
        when rank 0 was refused (another writer holds the lease); an unreachable index leaves this engine a
        reader, and the save goes on to fail at its commit, naming the index."""
        if self.is_writer:
            return
        outcome: tuple[str, Any] = ("", None)
        refused: BaseException | None = None
        if self.coordinator.rank == 0:  # every rank must reach the broadcast below, whatever happens here
            try:
                outcome = ("ok", await self.index.fence(self.job))
            except IndexUnavailable as e:
                log.warning("%s: not the job's writer yet; the next save tries again", e)
                outcome = ("unavailable", str(e))
            except TieredCkptError as e:  # WriterConflict, Fenced, AuthenticationError, ConfigError
                refused, outcome = e, ("refused", f"{type(e).__name__}: {e}")
            if outcome[0] == "ok":
                self.index.epoch = outcome[1]
                outcome = ("ok", outcome[1], await self._clean_leftovers())
        outcome = await self.coordinator.broadcast_object(outcome)
        if outcome[0] == "refused":
            raise refused if refused is not None else RankFailed(f"rank 0 could not become the writer: {outcome[1]}")
        if outcome[0] == "ok":
            self.index.epoch, self.is_writer = outcome[1], True
            self.removal.committed.update(outcome[2])  # listed again: saving those steps over is refused

    async def _clean_leftovers(self) -> list[int]:
        """Finish removals a crash cut short, list again what the index forgot (returned), and remove incomplete
        checkpoints newer than the newest complete one (a crashed run's, which this run would save over)."""
        relisted: list[int] = []
        try:
            await self.removal.finish_burials()
            relisted = await lineage.relist(self.removal.io, self.index, self.job, self.coordinator.session)
            complete = [s.step for s in await self.index.list(self.job) if s.is_complete]
            await self.removal.drop_incomplete_after(max(complete, default=-1))
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
