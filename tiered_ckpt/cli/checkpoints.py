"""One job's checkpoints, opened for the CLI's commands without the engine's save and load paths."""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Callable

from ..config import index_path
from ..distributed.coordinator import Coordinator
from ..lifecycle.busy import BusySteps
from ..lifecycle.gc import GcReport, GcScope, collect
from ..lifecycle.removal import Removal
from ..lifecycle.rules import Best
from ..lifecycle.writer import Writer
from ..load.catalog import Catalog
from ..storage.index import CheckpointStatus, open_index
from ..storage.tier_io import TierIO

if TYPE_CHECKING:
    from ..config import Config
    from ..load.export import ExportInfo
    from ..manifest import Manifest


class Checkpoints:
    """One job's checkpoints, opened for the commands: its tiers (TierIO), its index and catalog, and a
    cleaner's writer role (attach, never fence), as Engine.open() wires them, without staging buffers, the
    planner or the load path. One process, one rank, no collectives. Nothing here imports torch: `ls` and
    `gc` start at once; `show`, `verify` and `export` import it when they decode or read tensors."""

    def __init__(self, config: Config, *, read_only: bool = False):
        self.config = config
        self.read_only = read_only  # the command creates nothing (ls, show, verify, export, the dry runs)
        self.job = config.engine.job
        self.coordinator = Coordinator()  # single rank
        self.io = TierIO(config.tiers, config.engine.io_threads, background_nice=config.engine.background_nice)
        self.index = open_index(config.engine.index)
        self.catalog = Catalog(self.job, self.index, self.io, adopt=config.engine.adopt)
        self.busy = BusySteps()
        self.removal = Removal(self.job, self.index, self.io, self.busy, set())
        self.writer = Writer(self.job, self.index, self.coordinator, self.removal)
        self._jobs: dict[str, Checkpoints] = {self.job: self}

    def for_job(self, job: str) -> "Checkpoints":
        """Another job's checkpoints on the same tiers and index (`free --all-jobs`), opened with this one: its
        own catalog, removal and cleaner's writer role. The same object for the same job."""
        if job not in self._jobs:
            other = copy.copy(self)
            other.job = job
            other.catalog = Catalog(job, self.index, self.io, adopt=self.config.engine.adopt)
            other.busy = BusySteps()
            other.removal = Removal(job, self.index, self.io, other.busy, set())
            other.writer = Writer(job, self.index, self.coordinator, other.removal)
            self._jobs[job] = other
        return self._jobs[job]

    async def __aenter__(self) -> "Checkpoints":
        try:
            node, num_nodes = await self.coordinator.node()
            await self.io.open(rank=0, world_size=1, node=node, num_nodes=num_nodes)
            if not (self.read_only and self._missing_file_index()):
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

    async def __aexit__(self, *exc: Any) -> None:
        await self.io.close()
        await self.index.close()

    async def list(self) -> list[CheckpointStatus]:
        """Every checkpoint, oldest first, with size and metadata (as Engine.list)."""
        return await self.catalog.with_sizes(await self.catalog.statuses())

    async def status(self, step: int) -> CheckpointStatus | None:
        found = [s for s in await self.catalog.statuses() if s.step == step]
        return (await self.catalog.with_sizes(found))[0] if found else None

    async def latest(self) -> CheckpointStatus:
        """The checkpoint load() takes: the newest complete one that can be loaded."""
        return (await self.catalog.with_sizes([await self.catalog.pick(None, self.io.names)]))[0]

    async def best(self) -> CheckpointStatus:
        """The checkpoint load(best=True) takes (as Engine.best)."""
        return (await self.catalog.with_sizes([await self.catalog.pick(None, self.io.names, self.best_rule())]))[0]

    def best_rule(self) -> Best:
        return Best.required(self.config)

    async def read_manifest(self, step: int, tiers: list[str] | tuple[str, ...] | None = None) -> Manifest:
        return await self.catalog.read_manifest(step, self.io.names if tiers is None else self.io.order(tiers))

    async def attach(self, *, hold: bool = True) -> bool:
        """Become a cleaner (Engine.attach): True when no writer can run meanwhile."""
        return await self.writer.attach(hold=hold)

    async def delete(self, step: int) -> None:
        """Delete checkpoint `step` everywhere; attach() first."""
        await self.removal.delete(step)

    async def gc(self, *, dry_run: bool, grace: float, other_indexes: bool,
                 progress: Callable[[int, int], None]) -> GcReport:
        try:
            return await collect(GcScope(self.job, self.index, self.io, self.busy, self.writer), dry_run, grace=grace,
                                 other_indexes=other_indexes, progress=progress)
        finally:
            await self.writer.detach()

    async def export(self, path: str, *, to: str, step: int | None, select: str | None, force: bool,
                     progress: Callable[[int, int], None]) -> ExportInfo:
        from ..load.export import export

        return await export(self.catalog, self.io, self.busy.loading, path, to=to, step=step, select=select,
                            force=force, progress=progress)
