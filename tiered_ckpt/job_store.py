"""One job's checkpoints as they exist: what the engine and the command line both open.

A job's tiers (TierIO), its index, its catalog (what exists, where, and what can be loaded), the steps being
saved or read (never removed under them), the steps known complete, the one place that deletes (Removal) and
the writer role. `Engine` opens a store and adds the save and load paths on top; the CLI's commands open one
alone: no staging buffers, planner or load path, and nothing here imports torch (`ls` and `gc` start at
once; `show`, `verify` and `export` import it when they decode or read tensors).
"""
from __future__ import annotations

import copy
import logging
from typing import TYPE_CHECKING, Any, Callable

from .config import index_path
from .errors import IndexUnavailable
from .distributed.coordinator import Coordinator
from .lifecycle.busy import BusySteps
from .lifecycle.gc import GRACE, GcReport, GcScope, collect
from .lifecycle.removal import Reclaim, Removal
from .lifecycle.rules import Best
from .lifecycle.writer import Writer
from .load.catalog import Catalog
from .storage.index import CheckpointStatus, Index, open_index
from .storage.tier_io import TierIO

if TYPE_CHECKING:
    from .config import Config
    from .load.export import ExportInfo
    from .manifest import Manifest

log = logging.getLogger(__name__)


class JobStore:
    """One job's checkpoints: `io`, `index`, `catalog`, `busy`, `committed`, `removal` and `writer`, wired as
    every user of them needs. Built unopened; `open()` (or `async with`) starts the tiers and the index as
    the rank `coordinator` names (one rank, no collectives, unless the engine hands its own)."""

    def __init__(self, config: Config, *, read_only: bool = False):
        self.config = config
        self.read_only = read_only  # creates nothing (the CLI's ls, show, verify, export and dry runs)
        self.job = config.engine.job
        self.coordinator = Coordinator()  # single rank until open() is given the engine's
        self.io = TierIO(config.tiers, config.engine.io_threads, background_nice=config.engine.background_nice)
        self.index: Index = open_index(config.engine.index, timeout=config.engine.index_timeout)
        self.catalog = Catalog(self.job, self.index, self.io, adopt=config.engine.adopt, on_lost=config.engine.on_lost)
        self.busy = BusySteps()
        # steps complete on some tier that this process saved or its writer's start listed again (removal takes
        # them out); with the index unreachable at the open, also those the tiers' manifests show complete
        self.committed: set[int] = set()
        # the newest step the index held at the engine's open (`note_newest`): a step above it exists only if
        # this process saved it (one writer per job), so `is_saved` asks the index nothing for a new step
        self.newest_at_open: int | None = None
        # checkpoints a load found lost (on_lost): the next save removes them before it saves their steps again
        self.lost: set[int] = set()
        self._reclaim: Reclaim | None = None
        self._wire()
        self._jobs: dict[str, JobStore] = {self.job: self}

    def _wire(self) -> None:
        """The removal and the writer role, as this store's rank (open() may hand it the engine's)."""
        c = self.coordinator
        self.removal = Removal(self.job, self.index, self.io, self.busy, self.committed, rank=c.rank,
                               world_size=c.world_size, reclaim=self._reclaim)
        self.writer = Writer(self.job, self.index, c, self.removal, lease=self.config.engine.role == "writer")

    def for_job(self, job: str) -> "JobStore":
        """Another job's checkpoints on the same tiers and index (`free --all-jobs`): its own catalog, busy
        steps, removal and writer role. The same object for the same job."""
        if job not in self._jobs:
            other = copy.copy(self)
            other.job = job
            other.catalog = Catalog(job, self.index, self.io, adopt=self.config.engine.adopt,
                                    on_lost=self.config.engine.on_lost)
            other.busy = BusySteps()
            other.committed = set()
            other.lost = set()
            other._wire()
            self._jobs[job] = other
        return self._jobs[job]

    async def open(self, coordinator: Coordinator | None = None, *, reclaim: Reclaim | None = None) -> "JobStore":
        """Start the tiers and the index, as `coordinator`'s rank (default: one rank alone). `reclaim` is
        called as each removal from a tier starts (the engine's staging pool takes the buffer back)."""
        if coordinator is not None:
            self.coordinator = coordinator
        self._reclaim = reclaim
        self._wire()
        c = self.coordinator
        try:
            node, num_nodes = await c.node()
            await self.io.open(rank=c.rank, world_size=c.world_size, node=node, num_nodes=num_nodes)
            if self.read_only and self._missing_file_index():
                return self
            await self.index.open()
        except BaseException:
            self.io.shutdown()
            raise
        return self

    def _missing_file_index(self) -> bool:
        """A file index whose folder does not exist holds no checkpoints. A command that only reads skips the
        index's check that the folder could be created (a parent that is a file, or read-only): it creates
        nothing, so it lists nothing and is done (docs/operations.md, *CLI*)."""
        url = self.config.engine.index
        return url.startswith("file://") and not index_path(url).exists()

    async def close(self) -> None:
        await self.io.close()
        await self.index.close()

    async def __aenter__(self) -> "JobStore":
        return await self.open()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # -- what exists -----------------------------------------------------------------------------
    async def statuses(self) -> list[CheckpointStatus]:
        """Every checkpoint: from the index, or, when it is unreachable, from the manifests on the tiers."""
        return await self.catalog.statuses()

    async def list(self) -> list[CheckpointStatus]:
        """Every checkpoint, oldest first, with its size and metadata."""
        return await self.catalog.with_sizes(await self.catalog.statuses())

    async def status(self, step: int) -> CheckpointStatus | None:
        found = await self.catalog.status_of(step)
        return (await self.catalog.with_sizes([found]))[0] if found is not None else None

    async def note_newest(self) -> None:
        """At the engine's open: the newest step the index lists, one call whatever the history (the open no
        longer lists every checkpoint to refuse saving one again). With the index unreachable, the tiers'
        manifests are read once, here, as the open's listing did, so that no save waits on the index for this."""
        try:
            self.newest_at_open = await self.catalog.newest_step()
        except IndexUnavailable as e:
            log.warning("%s: the checkpoints a save must not write again are read from the tiers' manifests", e)
            found = await self.catalog.statuses_from_tiers()
            self.committed.update(s.step for s in found if s.is_complete)
            self.newest_at_open = max((s.step for s in found), default=-1)

    async def is_saved(self, step: int) -> bool:
        """Whether `step` is complete on some tier (a save of it is refused): this process's own saves, else,
        for a step not newer than the newest at open (a resumed run saves newer ones), its record in the index."""
        if step in self.committed:
            return True
        if self.newest_at_open is not None and step > self.newest_at_open:
            return False
        found = await self.catalog.status_of(step)
        return found is not None and found.is_complete

    async def latest(self) -> CheckpointStatus:
        """The checkpoint load() takes: the newest complete one that can be loaded."""
        return (await self.catalog.with_sizes([await self.catalog.pick(None, self.io.names)]))[0]

    async def best(self, tiers: list[str] | tuple[str, ...] | None = None) -> CheckpointStatus:
        """The checkpoint load(best=True) takes, among those complete on `tiers` (default: every tier)."""
        allowed = self.io.names if tiers is None else list(tiers)
        return (await self.catalog.with_sizes([await self.catalog.pick(None, allowed, self.best_rule())]))[0]

    def best_rule(self) -> Best:
        return Best.required(self.config)

    async def read_manifest(self, step: int, tiers: list[str] | tuple[str, ...] | None = None) -> Manifest:
        """The manifest: from the index, or else from the first of `tiers` (default: all, fastest first)."""
        return await self.catalog.read_manifest(step, self.io.names if tiers is None else self.io.order(tiers))

    async def export(self, path: str, *, to: str, step: int | None = None, select: str | None = None,
                     force: bool = False, progress: Callable[[int, int], None] | None = None) -> ExportInfo:
        """Write a checkpoint as safetensors, torch or DCP (read-only; see Engine.export)."""
        from .load.export import export

        return await export(self.catalog, self.io, self.busy, path, to=to, step=step, select=select,
                            force=force, progress=progress)

    # -- changing what exists --------------------------------------------------------------------
    async def attach(self, *, hold: bool = True) -> bool:
        """Become a cleaner (Engine.attach): True when no writer can run meanwhile."""
        return await self.writer.attach(hold=hold)

    async def detach(self) -> None:
        await self.writer.detach()

    async def delete(self, step: int) -> None:
        """Delete checkpoint `step` from every tier and the index; the caller holds a writer's or a cleaner's
        role."""
        await self.removal.delete(step)

    async def gc(self, *, dry_run: bool = False, grace: float = GRACE, other_indexes: bool = False,
                 progress: Callable[[int, int], None] | None = None) -> GcReport:
        """Remove what crashed runs left (Engine.gc). A cleaner's role taken for it ends with it; one the
        caller holds stays."""
        attached = self.writer.is_cleaner
        try:
            return await collect(GcScope(self.job, self.index, self.io, self.busy, self.writer), dry_run, grace=grace,
                                 other_indexes=other_indexes, progress=progress)
        finally:
            if not attached:
                await self.writer.detach()
