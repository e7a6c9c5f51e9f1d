"""Engine: save/load/list/delete. Orchestrates plan → stage → tier pipelines → commit; does no raw I/O.

Lifecycle: `async with Engine(config) as engine` opens the tiers and the index; `save` flattens the state,
plans (cached), waits for a staging buffer, copies the tensors into it and returns a SaveHandle while the
parts flow to the tiers in the background; `close` waits for every save in flight, then re-raises a
background error that no one observed (errors are never lost).
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable, Iterable, Sequence, TypeVar

import msgpack

from .config import Config, TierConfig, load_config
from .errors import CheckpointExists, IncompleteCheckpoint, IndexUnavailable, IntegrityError, StateError, TierError
from .index import CheckpointStatus, Index, open_index
from .loading import LoadInfo, plan_reads, read_parts
from .manifest import Manifest, RankMeta
from .pipeline import TierPipeline
from .dist.coordinator import Coordinator
from .plan import Planner
from .saving import SaveHandle, SaveJob
from .staging import StagingPool
from .state import decode_skeleton, flatten, match
from .tiers.base import Tier, manifest_key, rank_meta_key, step_prefix
from .tiers.registry import driver_class

T = TypeVar("T")
log = logging.getLogger(__name__)


class Engine:
    def __init__(self, config: Config):
        self.config = config
        self.job = config.engine.job
        self.coordinator = Coordinator()  # replaced at open() when a process group exists
        self.tier_configs: dict[str, TierConfig] = {t.name: t for t in config.tiers}
        self.tiers: dict[str, Tier] = {t.name: driver_class(t.kind)(t.name, t.options) for t in config.tiers}
        self.pipelines = {t.name: TierPipeline(t.name, workers=t.workers, inflight=t.inflight, retries=t.retries,
                                               timeout=t.timeout) for t in config.tiers}
        self.index: Index = open_index(config.engine.index)
        self.pool = StagingPool(config.engine.max_inflight)
        self.planner = Planner(config.engine.part_size, self.coordinator)
        self._executor = ThreadPoolExecutor(config.engine.io_threads, thread_name_prefix="tiered_ckpt")
        # One thread pool per tier, sized to its pipeline: a disk blocked in fsync must not starve the
        # memory tier, whose speed is what lets the next save reuse the staging buffer early.
        self._tier_executors = {t.name: ThreadPoolExecutor(t.workers, thread_name_prefix=f"tiered_ckpt-{t.name}")
                                for t in config.tiers}
        self._jobs: list[SaveJob] = []
        self._unobserved: list[SaveHandle] = []
        self._loading: Counter[int] = Counter()
        self._retention_lock = asyncio.Lock()
        self._complete: set[int] = set()
        self._state = "new"

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str], **overrides: Any) -> "Engine":
        """`overrides` replace `[engine]` keys, e.g. job="gpt"."""
        return cls(load_config(path, **overrides))

    # -- lifecycle -------------------------------------------------------------------------------
    async def open(self) -> "Engine":
        if self._state != "new":
            raise RuntimeError(f"engine is {self._state}; open it once")
        self.coordinator = await Coordinator.create(self.config.engine.collective_timeout)
        self.planner.coordinator = self.coordinator
        node, num_nodes = await self.coordinator.node()
        for name, tier in self.tiers.items():
            tier.executor = self._tier_executors[name]
            tier.bind(rank=self.rank, world_size=self.world_size, node=node, num_nodes=num_nodes)
            await tier.open()
        await self.index.open()
        # a new incarnation of the job: writers of earlier ones (zombie ranks) are fenced off
        epoch: int | None = None
        if self.rank == 0:
            try:
                epoch = await self.index.fence(self.job)
            except IndexUnavailable as e:
                log.warning("%s; saves will fail until it is back, loads read the manifests on the tiers", e)
        self.index.epoch = await self.coordinator.broadcast_object(epoch) or 0
        self._complete = {s.step for s in await self.statuses() if s.is_complete}
        self._state = "open"
        return self

    async def close(self, *, raise_errors: bool = True) -> None:
        """Wait for every save in flight, close tiers and index; raise an unobserved background error."""
        if self._state != "open":
            self._state = "closed"
            return
        self._state = "closing"
        await self.wait_all()
        for tier in self.tiers.values():
            await tier.close()
        await self.index.close()
        await self.coordinator.destroy()
        for executor in (self._executor, *self._tier_executors.values()):
            executor.shutdown(wait=False)
        self.pool.clear()
        self._state = "closed"
        unobserved = [h for h in self._unobserved if not h.observed]
        if unobserved and raise_errors:
            unobserved[0].observed = True
            await unobserved[0].wait()

    async def __aenter__(self) -> "Engine":
        return await self.open()

    async def __aexit__(self, exc_type: Any, *exc: Any) -> None:
        await self.close(raise_errors=exc_type is None)

    async def wait_all(self) -> None:
        """Wait until every save in flight has finished on every tier (errors stay in the handles)."""
        while self._jobs:
            await asyncio.wait([j.task for j in self._jobs if j.task is not None])

    def _check_open(self) -> None:
        if self._state != "open":
            raise RuntimeError(f"engine is {self._state}: use `async with Engine(...)` or `await engine.open()`")

    @property
    def rank(self) -> int:
        return self.coordinator.rank

    @property
    def world_size(self) -> int:
        return self.coordinator.world_size

    @property
    def session(self) -> str:
        return self.coordinator.session

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def tier_order(self, names: Iterable[str]) -> list[str]:
        """`names` sorted fastest first (the order of [[tiers]] in the config)."""
        wanted = set(names)
        return [n for n in self.tiers if n in wanted]

    # -- save ------------------------------------------------------------------------------------
    async def save(self, step: int, state: Any, *, lazy: bool = False,
                   metadata: dict[str, Any] | None = None) -> SaveHandle:
        """Stage `state` and persist it in the background as checkpoint `step`.

        Returns once the tensors are copied to host buffers (the caller may mutate them then). With
        lazy=True it returns at once and the copy runs in a thread: await `handle.staged()` before
        anything mutates the tensors (e.g. before optimizer.step()). At most max_inflight saves hold
        staging buffers; a further save waits here for one."""
        self._check_open()
        if type(step) is not int or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if step in self._complete:
            raise CheckpointExists(f"job {self.job!r} step {step} already exists; delete it to save it again")
        if any(j.step == step for j in self._jobs):
            raise CheckpointExists(f"job {self.job!r}: a save of step {step} is already in flight")
        metadata = dict(metadata or {})
        try:
            msgpack.packb(metadata)
        except (TypeError, ValueError) as e:
            raise StateError(f"metadata must be msgpack-able: {e}") from None
        flat = flatten(state, allow_pickle=self.config.engine.allow_pickle)
        targets = [self.tiers[t.name] for t in self.config.tiers if step % t.every == 0]
        handle = SaveHandle(step, [t.name for t in targets])
        if not targets:
            handle._set(handle._staged, None)
            return handle
        plan = await self.planner.plan(flat.paths, flat.tensors)
        if self.pool.exhausted:
            for job in self._jobs:
                job.request_detach()
        buffer = await self.pool.acquire(plan.nbytes)
        job = SaveJob(self, step, flat, plan, buffer, handle, targets, metadata)
        staging = asyncio.create_task(job.stage())
        job.task = asyncio.create_task(job.run(staging))
        self._jobs.append(job)
        job.task.add_done_callback(lambda _: self._finished(job))
        if not lazy:
            await handle.staged()
        return handle

    def _finished(self, job: SaveJob) -> None:
        self._jobs.remove(job)
        if not job.handle.observed and job.handle.errors:
            self._unobserved.append(job.handle)

    async def _begin(self, step: int, tiers: list[str]) -> None:
        """Record the save in the index. A single rank first clears what a crashed earlier attempt at `step`
        left; with several ranks, session-scoped markers keep such leftovers from counting, and `load`
        removes incomplete checkpoints newer than the one it resumes from."""
        for status in await self.index.list(self.job) if self.world_size == 1 else ():
            if status.step == step:
                if status.is_complete:
                    raise CheckpointExists(f"job {self.job!r} step {step} became complete elsewhere meanwhile")
                await self._forget(status)
        await self.index.begin(self.job, step, tiers)

    async def _forget(self, status: CheckpointStatus) -> None:
        """Remove a checkpoint everywhere. Index first: a crash part-way leaves unreferenced bytes on a
        tier, never a false "complete"."""
        await self.index.delete(self.job, status.step)
        self._complete.discard(status.step)
        for name in status.tiers:
            if name in self.tiers:
                await self.tiers[name].delete(step_prefix(self.job, status.step))

    async def _retain(self, tier: Tier, *, finishing: int | None = None) -> None:
        """Apply keep_last on `tier` as save `finishing` ends. Only complete checkpoints count, so a save
        in flight never pushes out the last complete one; other saves in flight and loads are untouched."""
        keep_last = self.tier_configs[tier.name].keep_last
        if keep_last is None:
            return
        async with self._retention_lock:
            try:
                statuses = await self.index.list(self.job)
                complete = sorted(s.step for s in statuses if tier.name in s.complete)
                if not complete:
                    return
                oldest_kept = complete[-keep_last:][0]
                busy = {j.step for j in self._jobs if j.step != finishing and not j.handle.done()} | {s for s, n in self._loading.items() if n}
                for s in statuses:
                    if tier.name in s.tiers and s.step < oldest_kept and s.step not in busy:
                        await self._drop(s, tier.name)
            except Exception as e:  # retention must never fail a save
                log.error("retention on tier %s failed: %s: %s", tier.name, type(e).__name__, e)

    async def _drop(self, status: CheckpointStatus, tier_name: str) -> None:
        """Remove `status.step` from one tier: the index record first (rank 0 keeps the books), then the
        data (every rank, so node-local tiers are cleaned on every node; on shared tiers it is idempotent)."""
        if self.rank == 0:
            await self.index.unmark(self.job, status.step, tier_name)
        if tier_name in self.tiers:
            await self.tiers[tier_name].delete(step_prefix(self.job, status.step))
        if not status.complete - {tier_name}:
            self._complete.discard(status.step)
        if self.rank == 0 and not set(status.tiers) - {tier_name}:
            await self.index.delete(self.job, status.step)

    # -- load ------------------------------------------------------------------------------------
    async def load(self, state: Any, *, step: int | None = None, tiers: Sequence[str] | None = None) -> LoadInfo:
        """Load the newest complete checkpoint (or `step`) into `state` in place.

        Reads each part from the fastest tier on which the checkpoint is complete; a missing part, a
        short read or a checksum mismatch falls back to the next tier (LoadInfo.fallbacks says which).
        `tiers` restricts which tiers may serve, in speed order."""
        self._check_open()
        started = time.perf_counter()
        allowed = list(self.tiers) if tiers is None else list(tiers)
        unknown = [t for t in allowed if t not in self.tiers]
        if unknown:
            raise ValueError(f"unknown tier(s) {unknown}; configured: {list(self.tiers)}")
        status = await self._agree_on_step(step, allowed)
        self._loading[status.step] += 1
        error: BaseException | None = None
        try:
            order = [self.tiers[n] for n in self.tier_order(status.complete) if n in allowed]
            manifest = await self.read_manifest(status.step, order)
            target = match(state, decode_skeleton(manifest.skeleton), allow_pickle=self.config.engine.allow_pickle,
                           describe=lambda i: (manifest.tensors[i].torch_dtype, manifest.tensors[i].shape))
            reads = plan_reads(manifest, target.tensors)
            info = LoadInfo(status.step, None)
            await read_parts(self, manifest, order, reads.dests, info)
            await self.run_blocking(reads.finish)
        except Exception as e:
            error = e
        finally:
            self._loading[status.step] -= 1
        await self.coordinator.agree(error)  # every rank succeeds, or every rank raises
        if error is not None:
            raise error
        target.apply()
        info.tier = max(info.bytes_by_tier, key=info.bytes_by_tier.__getitem__, default=order[0].name if order else None)
        info.seconds = time.perf_counter() - started
        if info.fallbacks:
            log.warning("step %d: %d part read(s) fell back to a slower tier: %s", info.step, len(info.fallbacks),
                        "; ".join(f"{f.part} on {f.tier}: {f.reason}" for f in info.fallbacks[:5]))
        return info

    async def _agree_on_step(self, step: int | None, allowed: list[str]) -> CheckpointStatus:
        """Rank 0 picks the checkpoint and every rank loads that one (or raises the same error). When
        resuming, rank 0 first deletes incomplete checkpoints newer than the pick: leftovers of the crashed
        run that the resumed run would otherwise save over."""
        if not self.coordinator.distributed:
            return await self._pick(step, allowed)
        choice: tuple[Any, ...]
        if self.rank == 0:
            try:
                status = await self._pick(step, allowed)
                if step is None:
                    await self._drop_incomplete_after(status.step)
                choice = ("ok", status)
            except IncompleteCheckpoint as e:
                choice = ("error", str(e))
        choice = await self.coordinator.broadcast_object(choice if self.rank == 0 else None)
        if choice[0] == "error":
            raise IncompleteCheckpoint(choice[1])
        return choice[1]

    async def _drop_incomplete_after(self, step: int) -> None:
        busy = {j.step for j in self._jobs}
        try:
            statuses = await self.index.list(self.job)
        except IndexUnavailable as e:
            log.warning("%s: leftovers of the crashed run are not cleaned up now", e)
            return
        for s in statuses:
            if s.step > step and not s.is_complete and s.step not in busy:
                log.info("removing incomplete checkpoint %d left by an earlier run", s.step)
                await self._forget(s)

    async def statuses(self) -> list[CheckpointStatus]:
        """Every checkpoint of the job: from the index, or, when the index is unreachable, from the
        manifests on the tiers (a step is complete on a tier when its manifest and every rank's checksum
        record are there, since each rank writes its record only after its parts are durable)."""
        try:
            return await self.index.list(self.job)
        except IndexUnavailable as e:
            log.warning("%s: listing checkpoints from the manifests on the tiers instead", e)
        return await self._statuses_from_tiers()

    async def _statuses_from_tiers(self) -> list[CheckpointStatus]:
        found: dict[int, dict[str, bool]] = {}
        for name, tier in self.tiers.items():
            try:
                keys = set(await tier.list(f"{self.job}/"))
            except TierError as e:
                log.warning("tier %s cannot be listed either: %s", name, e)
                continue
            for key in keys:
                if key.endswith("/manifest.msgpack"):
                    step = int(key.split("/")[1].removeprefix("step-"))
                    try:
                        manifest = Manifest.from_bytes(await tier.read(key), source=f"manifest on tier {name!r}")
                    except (TierError, IntegrityError):
                        continue
                    whole = all(rank_meta_key(self.job, step, r.rank) in keys for r in manifest.ranks)
                    found.setdefault(step, {})[name] = whole
        return [CheckpointStatus(step, tuple(self.tier_order(tiers)),
                                 frozenset(t for t, whole in tiers.items() if whole))
                for step, tiers in sorted(found.items())]

    async def _pick(self, step: int | None, allowed: list[str]) -> CheckpointStatus:
        statuses = await self.statuses()
        usable = [s for s in statuses if s.complete & set(allowed)]
        if not usable or (step is not None and all(s.step != step for s in usable)):
            # A fresh machine (an empty index) or a lost index: the tiers' manifests still know
            from_tiers = [s for s in await self._statuses_from_tiers() if s.complete & set(allowed)]
            if from_tiers if step is None else any(s.step == step for s in from_tiers):
                log.warning("job %r: the index has no usable checkpoint%s; using the manifests on the tiers",
                            self.job, "" if step is None else f" {step}")
                usable = from_tiers  # errors below still describe what the index knows
        if step is None:
            if not usable:
                raise IncompleteCheckpoint(f"job {self.job!r} has no complete checkpoint on tiers {allowed} "
                                           f"({len(statuses)} incomplete)")
            return max(usable, key=lambda s: s.step)
        for s in usable:
            if s.step == step:
                return s
        found = next((s for s in statuses if s.step == step), None)
        detail = "does not exist" if found is None else (
            f"is incomplete (targets {list(found.tiers)}, complete on {sorted(found.complete)}, "
            f"failed on {found.failed or 'none'})")
        raise IncompleteCheckpoint(f"job {self.job!r} step {step} {detail} on tiers {allowed}")

    async def read_manifest(self, step: int, tiers: Sequence[Tier] = ()) -> Manifest:
        """The manifest with every rank's checksums: from the index, or else from the first tier that has
        a valid copy (so a tier alone can restore)."""
        errors: list[str] = []
        manifest = await self._first_valid(
            lambda: self.index.get_manifest(self.job, step), tiers, manifest_key(self.job, step),
            lambda data, src: Manifest.from_bytes(data, source=src), "manifest", errors)
        records = {}
        for r in manifest.ranks:
            records[r.rank] = await self._first_valid(
                lambda r=r: self.index.get_rank_meta(self.job, step, r.rank), tiers,
                rank_meta_key(self.job, step, r.rank), lambda data, src: RankMeta.from_bytes(data, source=src),
                f"checksums of rank {r.rank}", errors)
        return manifest.with_checksums(records)

    async def _first_valid(self, from_index: Callable[[], Any], tiers: Sequence[Tier], key: str,
                           parse: Callable[[bytes, str], T], what: str, errors: list[str]) -> T:
        try:
            return parse(await from_index(), f"index {what}")
        except (IncompleteCheckpoint, IntegrityError, IndexUnavailable) as e:
            errors.append(str(e))
        for tier in tiers:
            try:
                return parse(await tier.read(key), f"{what} on tier {tier.name!r}")
            except TierError as e:
                errors.append(str(e))
        raise IncompleteCheckpoint(f"job {self.job!r}: no readable {what} ({'; '.join(errors)})")

    # -- list / delete ---------------------------------------------------------------------------
    async def list(self) -> AsyncIterator[CheckpointStatus]:
        """Every checkpoint of this job, oldest first, with the tiers it targets and those it is complete on."""
        self._check_open()
        for status in await self.statuses():
            yield status

    async def status(self, step: int) -> CheckpointStatus | None:
        """The index's record of checkpoint `step`, or None."""
        self._check_open()
        return next((s for s in await self.statuses() if s.step == step), None)

    async def delete(self, step: int) -> None:
        """Delete checkpoint `step` from every tier and the index (commit records first)."""
        self._check_open()
        if any(j.step == step and not j.handle.done() for j in self._jobs) or self._loading[step]:
            raise CheckpointExists(f"job {self.job!r} step {step} is being saved or loaded; try again later")
        for status in await self.index.list(self.job):
            if status.step == step:
                await self._forget(status)
                return
        raise IncompleteCheckpoint(f"job {self.job!r} has no checkpoint {step}")
