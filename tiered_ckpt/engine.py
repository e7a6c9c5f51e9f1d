"""Engine: save/load/list/delete. Orchestrates plan → stage → tier pipelines → commit; does no raw I/O.

Lifecycle: `async with Engine(config) as engine` opens the tiers and the index; `save` flattens the state,
plans (cached), waits for a staging buffer and hands the rest to a SaveJob, which copies the tensors into
the buffer and persists the parts to every tier in the background; `close` waits for every save in flight,
then re-raises a background error that no one observed (errors are never lost).

Who does what: TierIO (tiers behind their pipelines), Committer (the index side of a commit), Retention
(keep_last, deletion, busy steps), Catalog (which checkpoints exist, their manifests), Planner, StagingPool.
The engine builds them and passes each job only the ones it uses.
"""
from __future__ import annotations

import asyncio
import copy
import logging
import os
import time
import warnings
from typing import Any, AsyncIterator, Callable, Mapping, Sequence

import msgpack

from .load.catalog import Catalog
from .save.commit import Committer
from .config import Config, check_config, load_config
from .distributed.coordinator import Coordinator
from .errors import CheckpointExists, IncompleteCheckpoint, IndexUnavailable, RankFailed, StateError
from .load.export import ExportInfo
from .load.export import export as export_checkpoint
from .lifecycle.gc import GRACE, GcReport, collect
from .storage.index import CheckpointStatus, Index, open_index
from .load.reads import LoadInfo, Reads, plan_reads, read_parts
from .manifest import Manifest
from .save.plan import Planner
from .lifecycle.retention import Retention
from .save.job import SaveHandle, SaveJob, SaveServices
from .checksum import resolve as resolve_checksum
from .save.mapped import supported as mapped_supported
from .save.pool import Arena, StagingPool, producer_events
from .state import LoadTarget, SavedTensor, decode_skeleton, flatten, match
from .storage.tier_io import TierIO

log = logging.getLogger(__name__)
MAX_STEP = 2**53


class Engine:
    def __init__(self, config: Config):
        check_config(config)  # a Config built in code gets the checks a TOML file gets
        self.config = config
        self.job = config.engine.job
        self.coordinator = Coordinator()  # replaced at open() when a process group exists
        self.io = TierIO(config.tiers, config.engine.io_threads)
        self.tiers = self.io.drivers  # name → driver, fastest first
        self.pipelines = self.io.pipelines
        self.index: Index = open_index(config.engine.index)
        self.catalog = Catalog(self.job, self.index, self.io, adopt=config.engine.adopt)
        self.pool = StagingPool(config.engine.max_inflight)
        self.planner = Planner(config.engine.part_size, self.coordinator)
        self.retention = self._retention()
        self._jobs: list[SaveJob] = []
        # saves in flight: those holding staging buffers, and per tier one writing and one waiting its turn
        self._max_jobs = config.engine.max_inflight + 2 * len(config.tiers)
        self._unobserved: list[SaveHandle] = []
        self._services: SaveServices | None = None
        self._writer = False  # a reader until its first save: readers never fence and never delete
        self._cleaner = False  # attach()ed: may delete within the current incarnation (the CLI's delete, gc)
        self._state = "new"

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str], **overrides: Any) -> "Engine":
        """`overrides` replace `[engine]` keys, e.g. job="gpt"."""
        return cls(load_config(path, **overrides))

    def _retention(self) -> Retention:
        return Retention(self.job, self.index, self.io, {t.name: t.keep_last for t in self.config.tiers},
                         rank=self.rank, world_size=self.world_size, reclaim=self.pool.reclaim)

    # -- lifecycle -------------------------------------------------------------------------------
    async def open(self) -> "Engine":
        if self._state != "new":
            raise RuntimeError(f"engine is {self._state}; open it once")
        if self.config.engine.distributed:  # one rank of the default process group's world, when there is one
            self.coordinator = await Coordinator.create(self.config.engine.collective_timeout)
        # else (distributed = false) the single-rank Coordinator from __init__: no process group, no collectives
        self.planner.coordinator = self.coordinator
        node, num_nodes = await self.coordinator.node()
        await self.io.open(rank=self.rank, world_size=self.world_size, node=node, num_nodes=num_nodes)
        await self.index.open()
        self.pool.arena = self._arena()
        self.retention = self._retention()
        self.retention.complete = {s.step for s in await self.catalog.statuses() if s.is_complete}
        commit = Committer(self.index, self.job, rank=self.rank, world_size=self.world_size,
                           session=self.coordinator.session, timeout=self.config.engine.commit_timeout)
        # one algorithm for every rank ("auto" could resolve differently where xxhash is missing on a rank)
        algorithm = await self.coordinator.broadcast_object(resolve_checksum(self.config.engine.checksum))
        self._services = SaveServices(self.io, commit, self.retention, self.pool, algorithm)
        self._state = "open"
        return self

    def _arena(self) -> Arena | None:
        """Stage straight into the memory tier's files when it is first in the stack and keeps every save
        (every = 1) with a bounded keep_last; else anonymous staging buffers."""
        first, engine = self.config.tiers[0], self.config.engine
        if not (engine.stage_in_memory_tier and first.kind == "memory" and first.every == 1
                and first.keep_last is not None and mapped_supported(engine.part_size)):
            return None
        tier = self.tiers[first.name]
        return Arena(first.name, tier, Arena.home_for(tier, self.job, self.session, self.rank), engine.part_size,
                     first.keep_last, self.job)  # nothing on the tier changes before the first save

    async def close(self, *, raise_errors: bool = True) -> None:
        """Wait for every save in flight, close tiers and index; raise an unobserved background error."""
        if self._state != "open":
            self._state = "closed"
            return
        self._state = "closing"
        await self.wait_all()
        await self.io.close()
        await self.index.close()
        await self.coordinator.destroy()
        await self.pool.clear()
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

    @property
    def incarnation(self) -> str:
        """The folder (inside each step's) that this engine's saves write under: no other opening shares it."""
        return self._services.commit.incarnation

    # -- save ------------------------------------------------------------------------------------
    async def save(self, step: int, state: Any, *, lazy: bool = False, metadata: dict[str, Any] | None = None,
                   ready_events: Mapping[Any, Any] | None = None) -> SaveHandle:
        """Stage `state` and persist it in the background as checkpoint `step`.

        Returns once the tensors are copied to host buffers (the caller may mutate them then). With
        lazy=True it returns at once and the copy runs in a thread: await `handle.staged()` before
        anything mutates the tensors (e.g. before optimizer.step()). At most max_inflight saves hold
        staging buffers; a further save waits here for one. CUDA copies wait for `ready_events` (per device,
        from `staging.producer_events()` in the thread that runs the training step); by default they are
        recorded here, on the calling thread's current streams."""
        self._check_open()
        assert self._services is not None
        if type(step) is not int or not 0 <= step < MAX_STEP:
            raise ValueError(f"step must be an int from 0 to 2**53 - 1 (the Redis index orders steps as doubles), "
                             f"got {step!r}")
        if step in self.retention.complete:
            raise CheckpointExists(f"job {self.job!r} step {step} already exists; delete it to save it again")
        if any(j.step == step for j in self._jobs):
            raise CheckpointExists(f"job {self.job!r}: a save of step {step} is already in flight")
        targets = [t.name for t in self.config.tiers if step % t.every == 0]
        if not targets:  # nothing to write (every tier skips this step): no collective, no index change
            flatten(state, allow_pickle=self.config.engine.allow_pickle, rank=self.rank)  # bad input still raises
            handle = SaveHandle(step, targets)
            handle.set_staged()
            return handle
        if not self._writer:  # before anything that can fail on one rank only: every rank runs its collective
            await self._become_writer()
        try:
            metadata = _checked_metadata(metadata)
            # in a thread: a state of 100k tensors takes a second of Python, and the loop serves saves in flight
            flat = await asyncio.to_thread(flatten, state, allow_pickle=self.config.engine.allow_pickle,
                                           rank=self.rank)
        except Exception as e:
            if not self.coordinator.distributed:
                raise
            raise await self._failed_before_plan(step, targets, e) from e
        events = producer_events(flat.tensors) if ready_events is None else ready_events
        handle = SaveHandle(step, targets)
        plan = await self.planner.plan(flat.paths, flat.tensors)
        while len(self._jobs) >= self._max_jobs:  # bounded: a burst waits here, like a full staging pool
            await asyncio.wait([j.task for j in self._jobs if j.task is not None], return_when=asyncio.FIRST_COMPLETED)
        if self.pool.exhausted:
            for job in self._jobs:
                job.request_detach()
        buffer = await self.pool.acquire(plan.nbytes)
        job = SaveJob(self._services, step, flat, plan, buffer, handle, targets, metadata, events)
        job.start()
        self._jobs.append(job)
        self.retention.busy.saving(step, handle)
        assert job.task is not None
        job.task.add_done_callback(lambda _: self._finished(job))
        if not lazy:
            await handle.staged()
        return handle

    async def _become_writer(self) -> None:
        """At the first save (every rank: saves are SPMD): rank 0 fences earlier incarnations of the job
        (their commits and deletes are refused from now on) and removes what a crashed run left (incomplete
        checkpoints newer than the newest complete one); every rank takes the new epoch. Until then this
        engine is a reader: listing, loading, verifying change nothing in the index, so an evaluator or the
        CLI beside a running trainer cannot fence it or delete its saves in flight."""
        outcome: tuple[str, Any] = ("", None)
        refused: BaseException | None = None
        if self.rank == 0:  # every rank must reach the broadcast below, whatever happens here
            try:
                outcome = ("ok", await self.index.fence(self.job))
            except IndexUnavailable as e:  # the save goes on and fails at its commit, naming the index
                log.warning("%s: not the job's writer yet; the next save tries again", e)
                outcome = ("unavailable", str(e))
            except Exception as e:  # e.g. another writer holds the file index's lease
                refused, outcome = e, ("refused", f"{type(e).__name__}: {e}")
            if outcome[0] == "ok":
                self.index.epoch = outcome[1]
                try:
                    await self.retention.finish_burials()
                    complete = [s.step for s in await self.index.list(self.job) if s.is_complete]
                    await self.retention.drop_incomplete_after(max(complete, default=-1))
                except Exception as e:  # cleaning up must never fail a save
                    log.warning("leftovers of an earlier run were not removed: %s: %s", type(e).__name__, e)
        outcome = await self.coordinator.broadcast_object(outcome)
        if outcome[0] == "refused":
            raise refused if refused is not None else RankFailed(f"rank 0 could not become the writer: {outcome[1]}")
        if outcome[0] == "ok":
            self.index.epoch, self._writer = outcome[1], True

    async def _failed_before_plan(self, step: int, targets: list[str], error: BaseException) -> BaseException:
        """This rank cannot save its state: make the save fail on every rank, in bounded time. On a first
        save the other ranks wait in the plan gather, which this rank joins with its error; with cached
        plans they run no collective, so the failure is recorded on each target tier, where their commit
        wait sees it (RankFailed naming this rank, instead of a timeout)."""
        await self.planner.join_failed(error)  # raises RankFailed on every rank when it joined the gather
        assert self._services is not None
        for tier in targets:
            await self._services.commit.fail_tier(step, tier, error)
        return RankFailed(f"step {step}: rank {self.rank} failed before the save was planned: "
                          f"{type(error).__name__}: {error}")

    def _finished(self, job: SaveJob) -> None:
        self._jobs.remove(job)
        if job.task is not None and job.task.cancelled() and self._state == "open":
            message = (f"the save of step {job.step} (job {self.job!r}) was cancelled before it finished: was the "
                       f"event loop shut down without `await engine.close()`? Use `async with Engine(...)`")
            log.error(message)
            warnings.warn(message, ResourceWarning, stacklevel=2)
        self.retention.busy.saved(job.step)
        if not job.handle.observed and job.handle.errors:
            self._unobserved.append(job.handle)

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
        info = LoadInfo(status.step, None)
        order = [n for n in self.io.order(status.complete) if n in allowed]
        error: BaseException | None = None
        manifest: Manifest | None = None
        reads: Reads | None = None
        with self.retention.busy.loading(status.step):
            try:  # local work: a failure here must not make this rank skip the collectives below
                manifest = await self.catalog.read_manifest(status.step, order, status.incarnation)
                # in threads: pairing 100k entries with the saved ones is seconds of Python
                target = await asyncio.to_thread(self._match, state, manifest)
                reads = await asyncio.to_thread(plan_reads, manifest, target.tensors)
            except Exception as e:
                error = e
            try:  # every rank enters the same collectives, whatever happened above
                await read_parts(self.io, self.coordinator, manifest if error is None else None, order, reads, info)
            except Exception as e:
                error = error or e
            finally:
                self.io.bounce.clear()  # loads are rare: do not hold part-sized buffers between them
            try:
                await self.coordinator.agree(error)  # every rank succeeds, or every rank raises
            except Exception as e:
                raise _partly_overwritten(e, info.overwritten) if info.overwritten else e
            assert reads is not None
            await self.io.run_blocking(reads.finish)  # scratch → targets, only once every rank read everything
            await self.io.run_blocking(target.copy_ties)
        target.apply()
        info.tier = max(info.bytes_by_tier, key=info.bytes_by_tier.__getitem__, default=order[0] if order else None)
        info.seconds = time.perf_counter() - started
        if info.fallbacks:
            log.warning("step %d: %d part read(s) fell back to a slower tier: %s", info.step, len(info.fallbacks),
                        "; ".join(f"{f.part} on {f.tier}: {f.reason}" for f in info.fallbacks[:5]))
        return info

    def _match(self, state: Any, manifest: Manifest) -> LoadTarget:
        """Pair `state` with this rank's saved skeleton (rank 0's for a rank the saved world lacked); keys it
        lacks are looked up in the other ranks' skeletons."""
        source = self.rank if self.rank < manifest.world_size else 0
        others = [lambda r=r: decode_skeleton(manifest.skeleton_of(r)) for r in range(len(manifest.ranks)) if r != source]
        saved = {t.path: SavedTensor(i, t.torch_dtype, t.shape) for i, t in enumerate(manifest.tensors)}
        return match(state, decode_skeleton(manifest.skeleton_of(source)), tensors=saved, others=others,
                     allow_pickle=self.config.engine.allow_pickle, rank=self.rank, saved_world=manifest.world_size)

    async def _agree_on_step(self, step: int | None, allowed: list[str]) -> CheckpointStatus:
        """Rank 0 picks the checkpoint and every rank loads that one (or raises the same error). A writer
        resuming (step=None) has rank 0 first delete incomplete checkpoints newer than the pick: leftovers of
        a failed or crashed save that it would otherwise save over. A reader deletes nothing."""
        if not self.coordinator.distributed:
            return await self.catalog.pick(step, allowed)
        choice: tuple[Any, ...]
        if self.rank == 0:
            try:
                status = await self.catalog.pick(step, allowed)
                if step is None and self._writer:
                    await self.retention.drop_incomplete_after(status.step)
                choice = ("ok", status)
            except IncompleteCheckpoint as e:
                choice = ("missing", str(e))
            except Exception as e:  # every rank must leave the broadcast below with the same answer
                choice = ("error", f"{type(e).__name__}: {e}")
        choice = await self.coordinator.broadcast_object(choice if self.rank == 0 else None)
        if choice[0] == "missing":
            raise IncompleteCheckpoint(choice[1])
        if choice[0] == "error":
            raise RankFailed(f"rank 0 failed while picking the checkpoint to load: {choice[1]}")
        return choice[1]

    async def statuses(self) -> list[CheckpointStatus]:
        """Every checkpoint of the job: from the index, or, when the index is unreachable, from the
        manifests on the tiers."""
        return await self.catalog.statuses()

    async def read_manifest(self, step: int, tiers: Sequence[str] | None = None) -> Manifest:
        """The manifest with every rank's checksums: from the index, or else from the first of `tiers`
        (default: every configured tier, fastest first) with a valid copy."""
        return await self.catalog.read_manifest(step, list(self.tiers) if tiers is None else self.io.order(tiers))

    async def export(self, path: str | os.PathLike[str], *, to: str, step: int | None = None,
                     select: str | None = None, force: bool = False,
                     progress: Callable[[int, int], None] | None = None) -> ExportInfo:
        """Write checkpoint `step` (default: the newest complete one) to `path` as "safetensors", "torch"
        (torch.save) or "dcp" (a torch.distributed.checkpoint directory), sharded tensors assembled whole;
        `select` keeps one subtree ("model"), names relative to it. Read-only: never fences, commits or
        deletes, so it may run beside a trainer; it uses no collectives (call it on one rank). An existing
        `path` is replaced only with force=True. `progress(done, total)` gets bytes of tensor data.
        Returns what was written (tensors, bytes, plain values, what was left out). See docs/export.md."""
        self._check_open()
        return await export_checkpoint(self, path, to=to, step=step, select=select, force=force, progress=progress)

    # -- list / delete ---------------------------------------------------------------------------
    async def list(self) -> AsyncIterator[CheckpointStatus]:
        """Every checkpoint of this job, oldest first, with the tiers it targets and those it is complete on,
        its size (`nbytes`) and the `metadata` given to save(): both recorded at begin, so no manifest is read
        (but once per checkpoint saved by an earlier release, from the index)."""
        self._check_open()
        for status in await self.catalog.with_sizes(await self.statuses()):
            yield status

    async def status(self, step: int) -> CheckpointStatus | None:
        """The index's record of checkpoint `step`, or None."""
        self._check_open()
        found = [s for s in await self.statuses() if s.step == step]
        return (await self.catalog.with_sizes(found))[0] if found else None

    async def delete(self, step: int) -> None:
        """Delete checkpoint `step` from every tier and the index (commit records first)."""
        self._check_open()
        if not self._writer and not self._cleaner:  # a writer's act (with several ranks, every rank calls delete)
            await self._become_writer()
        await self.retention.delete(step)

    async def attach(self, *, hold: bool = True) -> bool:
        """Become a cleaner of the job without starting a new incarnation: `delete` and `gc` then change the
        index within the current one, so a trainer that is still running is not fenced out (the CLI's
        `delete` and `gc` do this; a save still fences, as a writer's first save does). Returns True when no
        writer of the job can run meanwhile: this engine is the writer, or the file index's writer lease was
        free (with `hold`, it is held until detach() or close, and a writer's first save waits for it; without,
        only tested). False when one may be running (the lease is held elsewhere; with Redis, always)."""
        self._check_open()
        if self._writer:
            return True
        attach = getattr(self.index, "attach", None)
        if attach is None:  # an index without attach(): only a writer may delete
            if hold:
                await self._become_writer()
            return hold
        exclusive = await attach(self.job, hold=hold)
        self._cleaner = self._cleaner or hold
        return exclusive

    async def detach(self) -> None:
        """The cleaning is done: release what attach() holds (the file index's lease), so a trainer's first
        save does not wait for this engine to close. A writer keeps its lease."""
        self._check_open()
        if self._cleaner and not self._writer:
            self._cleaner = False
            detach = getattr(self.index, "detach", None)
            if detach is not None:
                await detach(self.job)

    async def gc(self, *, dry_run: bool = False, grace: float = GRACE, other_indexes: bool = False,
                 progress: Callable[[int, int], None] | None = None) -> GcReport:
        """Remove what crashed runs left: incomplete checkpoints no save is writing, folders of this index
        other than a step's committed one, tiers a checkpoint never completed on, removals cut short, temp
        files and empty folders older than `grace` seconds; with a writer possibly running (Redis, or the file
        index's lease held), incomplete saves only once they began more than `grace` ago. dry_run reports the
        same and changes nothing. No collectives: call it on one process (once per node for node-local
        tiers). See tiered_ckpt/gc.py and docs/operations.md."""
        self._check_open()
        attached = self._cleaner  # a caller's own attach() stays; one taken for this gc ends with it
        try:
            return await collect(self, dry_run, grace=grace, other_indexes=other_indexes, progress=progress)
        finally:
            if not attached:
                await self.detach()


def _checked_metadata(metadata: dict[str, Any] | None) -> dict[str, Any]:
    metadata = dict(metadata or {})
    try:
        msgpack.packb(metadata)
    except (TypeError, ValueError) as e:
        raise StateError(f"metadata must be msgpack-able: {e}") from None
    return metadata


def _partly_overwritten(error: BaseException, keys: set[str]) -> BaseException:
    """A load that failed after some verified parts reached the given state: the same error, saying which
    entries changed."""
    shown = sorted(keys)
    more = f" and {len(shown) - 10} more" if len(shown) > 10 else ""
    wrapped = copy.copy(error)
    wrapped.args = (f"{error} (entries of the given state already overwritten with checkpoint data: "
                    f"{shown[:10]}{more}; the others are untouched)",)
    wrapped.__cause__ = error
    return wrapped
