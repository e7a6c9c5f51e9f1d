"""Removing checkpoints: the one place that deletes a checkpoint's records and data.

Every removal drops the index record before the data, so a crash part-way leaves unreferenced bytes on a
tier, never a "complete" entry whose parts are gone. A checkpoint removed everywhere is first *buried* (a
tombstone): until every tier's data is gone it can neither come back from the tiers' manifests nor keep its
data, and the next writer (or `gc`) finishes the job. Busy steps (lifecycle/busy.py) are never removed.
"""
from __future__ import annotations

import logging
from typing import Awaitable, Callable, Sequence

from ..errors import CheckpointExists, IncompleteCheckpoint, IndexUnavailable, TierError, TierNotFound
from ..layout import index_dir, manifest_key, parse_key, step_prefix
from ..manifest import Manifest
from ..storage.index import CheckpointStatus, Index, status_of
from ..storage.tier_io import TierIO
from .busy import BusySteps

log = logging.getLogger(__name__)
Reclaim = Callable[[str, int], Awaitable[None]]  # a step leaves a tier: the staging pool takes back its files


async def remove_checkpoint(index: Index, job: str, step: int, removals: Sequence[tuple[str, Callable[[], Awaitable[object]]]],
                            *, bury: bool = True, forget: bool = True) -> list[str]:
    """Bury `step`, drop its index record (`forget`), run every data removal, and unbury it only when every
    one succeeded: else the tombstone stays for the next writer or gc. Returns what failed, named."""
    if bury:
        await index.bury(job, step)
    if forget:
        await index.delete(job, step)
    failed = []
    for what, remove in removals:
        try:
            await remove()
        except TierError as e:
            failed.append(f"{what}: {type(e).__name__}: {e}")
    if not failed:
        await index.unbury(job, step)
    return failed


class Removal:
    def __init__(self, job: str, index: Index, io: TierIO, busy: BusySteps, committed: set[int], *, rank: int = 0,
                 world_size: int = 1, reclaim: Reclaim | None = None):
        self.job = job
        self.index = index
        self.io = io
        self.busy = busy
        self.committed = committed  # steps complete on some tier as far as this process knows (shared)
        self.relisted: set[int] = set()  # steps the writer's start listed again: retention judges them once by name
        self.rank = rank
        self.world_size = world_size
        self.reclaim = reclaim

    async def delete(self, step: int) -> None:
        """Delete checkpoint `step` everywhere; refused while it is busy."""
        if step in self.busy.steps():
            raise CheckpointExists(f"job {self.job!r} step {step} is being saved or loaded; try again later")
        status = await status_of(self.index, self.job, step)
        if status is None:
            raise IncompleteCheckpoint(f"job {self.job!r} has no checkpoint {step}")
        await self.forget(status)

    async def forget(self, status: CheckpointStatus) -> None:
        """Remove a checkpoint everywhere (its tombstone stays if a tier's data could not be removed)."""
        self.committed.discard(status.step)
        await self._remove_everywhere(status.step, self.io.order(status.tiers), bury=True, forget=True)

    async def finish_burials(self) -> None:
        """A writer starting: remove the data of checkpoints whose removal a crash cut short."""
        for step in sorted(await self.index.buried(self.job)):
            log.info("finishing the removal of checkpoint %d, cut short earlier", step)
            await self._remove_everywhere(step, self.io.names, bury=False, forget=True)

    async def _remove_everywhere(self, step: int, tiers: Sequence[str], *, bury: bool, forget: bool) -> None:
        removals = [(f"tier {t}", lambda t=t: self.remove_from_tier(t, step)) for t in tiers]
        failed = await remove_checkpoint(self.index, self.job, step, removals, bury=bury, forget=forget)
        if failed:
            raise TierError(f"checkpoint {step} of job {self.job!r} is out of the index and buried (never listed or "
                            f"loaded again), but some of its data could not be removed ({'; '.join(failed)}); the "
                            f"next writer or `tiered-ckpt gc` finishes it once the tier accepts removals")

    async def clear_crashed_attempt(self, step: int) -> None:
        """Before saving `step` (single rank): remove what a crashed earlier attempt at it left. With several
        ranks, session-scoped markers keep such leftovers from counting, and a resuming writer removes them."""
        if self.world_size > 1:
            return
        status = await status_of(self.index, self.job, step)  # one step asked for: not the whole history
        if status is not None:
            if status.is_complete:
                raise CheckpointExists(f"job {self.job!r} step {step} became complete elsewhere meanwhile")
            await self.forget(status)

    async def drop_incomplete_after(self, step: int, statuses: Sequence[CheckpointStatus] | None = None) -> None:
        """A writer starting from `step`: remove incomplete checkpoints newer than it, leftovers of the crashed
        run that the resumed run would otherwise save over. `statuses`: the index's listing, when the caller made
        one just before."""
        if statuses is None:
            try:
                statuses = await self.index.list(self.job)
            except IndexUnavailable as e:
                log.warning("%s: leftovers of the crashed run are not cleaned up now", e)
                return
        busy = self.busy.steps()
        for s in statuses:
            if s.step > step and not s.is_complete and s.step not in busy:
                log.info("removing incomplete checkpoint %d left by an earlier run", s.step)
                await self.forget(s)

    async def drop_tier(self, status: CheckpointStatus, tier: str) -> None:
        """Remove `status.step` from one tier: the index record first (rank 0 keeps the books), then the data
        (every rank, so node-local tiers are cleaned on every node; on shared tiers it is idempotent)."""
        with self.busy.removing(status.step, tier):  # (a load picking the step meanwhile reads it elsewhere)
            last = not set(status.tiers) - {tier}  # the step's last tier: the checkpoint goes away entirely
            if self.rank == 0:
                if last:
                    await self.index.bury(self.job, status.step)
                await self.index.unmark(self.job, status.step, tier)
            if tier in self.io:
                await self.remove_from_tier(tier, status.step)
            if not status.complete - {tier}:
                self.committed.discard(status.step)
            if self.rank == 0 and last:
                await self.index.delete(self.job, status.step)
                await self.index.unbury(self.job, status.step)
            elif self.rank == 0:
                await self._forget_if_emptied(status.step)

    async def _forget_if_emptied(self, step: int) -> None:
        """Two processes each retired one of a step's two tiers at once (the trainer its memory tier, the node agent
        of a gone trainer its disk): each saw the other's tier still listed, so neither took the record out. The
        one that finds the step on no tier afterwards does, and leaves it buried (the other's removal may still be
        running: the next writer or gc finishes the burial). Not listed at all is the same (a Redis index lists no
        step left on no tier, but keeps its record; or the other process took it out already: then this buries
        nothing for the next writer to finish)."""
        status = await status_of(self.index, self.job, step)
        if status is None or not status.tiers:
            await self.index.bury(self.job, step)
            await self.index.delete(self.job, step)

    async def remove_from_tier(self, tier: str, step: int) -> None:
        """Every folder this index's incarnations wrote for `step`, and its folder-less keys of formats 1 and
        2 unless their manifest names another index. Nothing else under the step folder: another index's
        folders (an unrelated run sharing the tier's path and job name), a write in progress that a listing
        does not show. (File tiers remove a folder left empty.)"""
        with self.busy.removing(step, tier):
            await self._remove_from_tier(tier, step)

    async def _remove_from_tier(self, tier: str, step: int) -> None:
        if self.reclaim is not None:
            await self.reclaim(tier, step)
        prefix, mine = step_prefix(self.job, step), index_dir(self.index.identity)
        parsed = [(k, parse_key(k)) for k in await self.io.list(tier, prefix)]
        await self.io.delete(tier, f"{prefix}{mine}/")
        legacy = [k for k, p in parsed if p is not None and not p.incarnation]
        ours = any(p is not None and p.incarnation.startswith(mine + "/") for _, p in parsed)
        # without a folder of this index, the step this index lists is the folder-less one
        if legacy and (not ours or await self._legacy_is_mine(tier, step)):
            for key in legacy:
                await self.io.delete(tier, key)

    async def _legacy_is_mine(self, tier: str, step: int) -> bool:
        """Folder-less (format 1-2) keys beside this index's folder: this index's only if their manifest says so."""
        key = manifest_key(self.job, step)
        try:
            data = await self.io.read(tier, key)
            manifest = await self.io.run_blocking(lambda: Manifest.from_bytes(data, source=f"{key} on tier {tier!r}"))
        except TierNotFound:
            return True  # no manifest (a crashed save of an earlier release): nothing says it is another's
        except TierError:
            return False
        return manifest.index in ("", self.index.identity)
