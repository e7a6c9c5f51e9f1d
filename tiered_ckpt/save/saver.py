"""`Engine.save`: check the step, flatten and plan the state, wait for room, then start a SaveJob. Tracks the
saves in flight, and raises once, at the next `save()` or at `close()`, what the failure policy says stops
training (save/failures.py), and at `close()` a newest save that committed on no tier and that nobody waited on;
a tier's failure alone is recorded and warned about, never raised into the loop. Saves (and `reserve()`)
called at once on one engine start one at a time, in call order: each start may become the writer and runs
collectives, which every rank must run in the same order."""
from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import time
import warnings
from typing import Any, Callable, Mapping

import msgpack
import torch

from ..config import Config
from ..distributed.coordinator import Coordinator
from ..errors import (CheckpointExists, ConfigError, RankFailed, SaveError, StateError, TierError, TieredCkptError,
                      TierFull)
from ..lifecycle.busy import BusySteps
from ..lifecycle.writer import Writer
from ..sizes import format_size
from ..state import FlatState, flatten
from ..gc_pause import automatic_gc_paused
from .copy import prepare, producer_events
from .early import EarlyCopies, Launch
from .failures import FailurePolicy
from .reserve import Reservation, room_error
from .handle import SaveHandle
from .host_budget import HostFit, fit_host_memory, ranks_per_machine
from .job import SaveJob, SaveServices
from .plan import Plan, Planner

log = logging.getLogger(__name__)
MAX_STEP = 2**53


class Saver:
    def __init__(self, config: Config, coordinator: Coordinator, planner: Planner, writer: Writer, busy: BusySteps,
                 services: SaveServices, is_open: Callable[[], bool]):
        self.config = config
        self.job = config.engine.job
        self.coordinator = coordinator
        self.planner = planner
        self.writer = writer
        self.busy = busy
        self.services = services
        self._is_open = is_open
        self.jobs: list[SaveJob] = []
        # saves in flight: those holding staging buffers, and per tier one writing and one waiting its turn
        self._max_jobs = config.engine.max_inflight + 2 * len(config.tiers)
        required = frozenset(t.name for t in config.tiers if t.required)
        self.failures = FailurePolicy(self.job, required, config.engine.stop_after_failed_saves)
        self.host_fit: HostFit | None = None  # how the stack fits [engine] host_memory for the current state size
        self.early = EarlyCopies() if torch.cuda.is_available() else None  # where the next save's copies go
        self._dropping: set[asyncio.Future[None]] = set()  # launches being dropped (held: a task is weakly kept)
        self._newest: SaveHandle | None = None  # the save of the newest step started (close() looks at it)
        self.starting = asyncio.Lock()  # one save, reserve or first delete starts at a time (FIFO)

    async def start(self, step: int, state: Any, *, metadata: dict[str, Any] | None,
                    ready_events: Mapping[Any, Any] | None) -> SaveHandle:
        """A save up to its copy running (one at a time, in call order); `staged` waits for the copy."""
        started = time.perf_counter()  # handle.durable_at counts from here
        async with self.starting:
            return await self._start(step, state, started, metadata, ready_events)

    @staticmethod
    async def staged(handle: SaveHandle) -> None:
        """A plain save's wait for its copy. Cancelled, it still waits for the copy to end, then raises
        CancelledError: the save goes on, and nothing the caller changes after the cancel reaches the checkpoint
        (a failure is raised at the next save)."""
        try:
            await handle.staged()
        except asyncio.CancelledError:
            await handle.copy_ended()
            raise
        except Exception:
            handle.observed = True  # raised here, to the caller: not again at the next save or close()
            raise

    async def _start(self, step: int, state: Any, started: float, metadata: dict[str, Any] | None,
                     ready_events: Mapping[Any, Any] | None) -> SaveHandle:
        """Everything of a save up to its SaveJob running: checks, the writer, walk, plan, a buffer."""
        if type(step) is not int or not 0 <= step < MAX_STEP:
            raise ValueError(f"step must be an int from 0 to 2**53 - 1 (the Redis index orders steps as doubles), "
                             f"got {step!r}")
        self.raise_unobserved()
        engine, rank = self.config.engine, self.coordinator.rank
        if engine.role == "reader":
            raise ConfigError(f"job {self.job!r}: this engine is a reader: it never saves; a trainer's engine takes "
                              f"role \"writer\" or \"auto\"", key="engine.role", file=self.config.source)
        if any(j.step == step for j in self.jobs):
            raise CheckpointExists(f"job {self.job!r}: a save of step {step} is already in flight")
        targets = [t.name for t in self.config.tiers if step % t.every == 0]
        if not targets:  # nothing to write (every tier skips this step): no collective, no index change
            await self._check_new(step)
            await asyncio.to_thread(flatten, state, allow_pickle=engine.allow_pickle, rank=rank)  # bad input raises
            handle = SaveHandle(step, targets, started=started, required=self.failures.required)
            handle.set_staged()
            return handle
        # before anything that can fail on one rank only (every rank runs its collective), and before "step N
        # exists": a second trainer of the job learns of the writer it runs beside, not that it should delete N
        await self.writer.become()
        if self.services.lost:
            await self._remove_lost()
        await self._check_new(step)
        launch = await self._launch(ready_events)  # GPU copies launched during the walk (early.py), or None
        try:
            try:
                metadata = _checked_metadata(metadata)
                # in a thread: a state of 100k tensors takes a second of Python, and the loop serves saves in flight
                with automatic_gc_paused():  # (gc_pause.py)
                    flat = await asyncio.to_thread(_walk, state, engine.allow_pickle, rank, launch)
            except Exception as e:
                if not self.coordinator.distributed:
                    raise
                raise await self._failed_before_plan(step, targets, e) from e
            if ready_events is not None:
                events = ready_events
            elif launch is not None and launch.ok:
                events = launch.events  # recorded before the walk, for the devices that every box's source is on
            else:
                events = producer_events(flat.tensors)
            handle = SaveHandle(step, targets, started=started, required=self.failures.required)
            with automatic_gc_paused():  # a plan of 100k tensors (a cached one: its key alone)
                plan = await self.planner.plan(flat.paths, flat.tensors)
            if launch is not None and plan is not launch.plan:  # the state changed: its buffer may not fit
                launch, dropped = None, launch
                await self._drop_launch(dropped)
            self._fit_host_memory(plan)  # the same verdict on every rank (from every rank's bytes), before any buffer
        except BaseException:
            if launch is not None:
                await self._drop_launch(launch)
            raise
        handle.nbytes = plan.nbytes
        if launch is not None:
            buffer = launch.buffer
        else:
            while len(self.jobs) >= self._max_jobs:  # bounded: a burst waits here, like a full staging pool
                await asyncio.wait([j.task for j in self.jobs if j.task is not None],
                                   return_when=asyncio.FIRST_COMPLETED)
            pool = self.services.pool
            if pool.exhausted:
                for job in self.jobs:
                    job.request_detach()
            buffer = await pool.acquire(plan.nbytes)
        job = SaveJob(self.services, step, flat, plan, buffer, handle, targets, metadata, events, launch, self.early)
        self.failures.watch(handle)
        if self._newest is None or step > self._newest.step:
            self._newest = handle
        job.start()
        self.jobs.append(job)
        self.busy.saving(step, handle)
        assert job.task is not None
        job.task.add_done_callback(lambda _: self._finished(job))
        return handle

    async def _launch(self, ready_events: Mapping[Any, Any] | None) -> Launch | None:
        """Take a buffer for the plan of the last save and start a launch into it, where that save had GPU
        tensors to copy and nothing has to wait (no full pool, no burst of saves): those take the usual path."""
        known, plan = self.early.learned if self.early is not None else None, self.planner.last  # read once
        if known is None or plan is None or plan is not known.plan or not known.rows:
            return None
        pool = self.services.pool
        if len(self.jobs) >= self._max_jobs or pool.exhausted:
            return None
        if ready_events is None:  # recorded at once: the values at save(), as the walk goes on in a thread
            ready_events = producer_events(devices=known.cuda)
        buffer = await pool.acquire(plan.nbytes)
        assert self.early is not None
        return self.early.launch(known, buffer, ready_events)

    async def _drop_launch(self, launch: Launch) -> None:
        """A launch that no save will use: no more copies are launched (a walk cancelled with its save may go on
        in its thread), those launched land, then its buffer goes back to the pool. Shielded: a cancel here does
        not hand the buffer back before the copies have landed."""
        async def drop() -> None:
            try:
                await asyncio.to_thread(_close_and_wait, launch)
            except Exception as e:  # a broken device: nothing more lands
                log.warning("waiting for a dropped save's copies: %s: %s", type(e).__name__, e)
            await self.services.pool.release(launch.buffer)

        task = asyncio.ensure_future(drop())
        self._dropping.add(task)
        task.add_done_callback(self._dropping.discard)
        await asyncio.shield(task)

    async def reserve(self, state: Any) -> Reservation:
        """Engine.reserve (collective, like a save: every rank calls it with its state)."""
        if self.config.engine.role == "reader":
            raise ConfigError(f"job {self.job!r}: this engine is a reader: it never saves, so it reserves nothing",
                              key="engine.role", file=self.config.source)
        async with self.starting:
            await self.writer.become()  # as a save's start: the lease, the probes, the leftovers
            with automatic_gc_paused():  # its per-tensor Python: walk, plan, every buffer's views (gc_pause.py)
                return await self._reserve(state)

    async def _reserve(self, state: Any) -> Reservation:
        engine, coordinator = self.config.engine, self.coordinator
        try:
            flat = await asyncio.to_thread(flatten, state, allow_pickle=engine.allow_pickle, rank=coordinator.rank)
        except Exception as e:
            if coordinator.distributed:
                await self.planner.join_failed(e)  # the others wait in the plan gather: RankFailed on every rank
            raise
        plan = await self.planner.plan(flat.paths, flat.tensors)  # cached: the first save plans nothing more
        self._fit_host_memory(plan)  # may lower the memory tier's keep_last: fewer buffers to make
        pool = self.services.pool
        await pool.settle()  # a buffer being made ahead counts once it is there
        count, arena = pool.missing(plan.nbytes), pool.arena
        need = count * (plan.nbytes if arena is None else arena.file_bytes(plan.nbytes))
        machine = [(coordinator.host, need, pool.staging_bytes(plan.nbytes) + count * plan.nbytes)]
        if coordinator.distributed:
            machine = [m for m in await coordinator.all_gather_object(machine[0]) if m[0] == coordinator.host]
        error: BaseException | None = None
        if arena is not None and count:
            try:  # whatever fails here on one rank fails the reservation on every rank, at agree()
                arena.check_fits(plan.nbytes, pool.max_inflight)
                folder = next(p for p in (arena.home, *arena.home.parents) if p.exists())
                error = room_error(arena.name, str(folder), sum(need for _, need, _ in machine), len(machine))
            except Exception as e:
                error = e
        await coordinator.agree(error)  # the same error on every rank, before any rank makes a buffer
        error = None
        try:
            await pool.drop_unfit(plan.nbytes)  # free buffers made for a state of another size
            await pool.reserve(plan.nbytes, count, plan)
            if self.early is not None:  # the gather's scratch too, and where the first save's copies go
                await asyncio.to_thread(prepare, plan, flat.tensors, pool.gatherer, self.early)
        except Exception as e:
            error = e
            if arena is not None and isinstance(e, OSError) and not isinstance(e, TierError) \
                    and e.errno in (errno.ENOSPC, errno.ENOMEM):  # the tmpfs filled meanwhile (another process)
                error = TierFull(f"reserving staging buffers on {arena.home}: {e}", tier=arena.name)
        await coordinator.agree(error)  # what was made stays, and is used by the saves
        fit = self.host_fit
        return Reservation(plan.nbytes, count, pool.buffers + len(pool.retained), pool.staging_bytes(plan.nbytes),
                           sum(total for _, _, total in machine), arena.name if arena is not None else None,
                           fit.budget if fit is not None else None, dict(fit.keep_last) if fit is not None else {})

    def _fit_host_memory(self, plan: Plan) -> None:
        """Fit the tier stack into [engine] host_memory for this state (save/host_budget.py): the memory tiers'
        retention, and the memory tier's staging buffers, keep the keep_last that fits. Decided from the largest
        rank's bytes and the most crowded machine, so every rank decides alike. ConfigError when nothing fits."""
        state = plan.max_nbytes
        if self.config.engine.host_memory is None or (self.host_fit is not None and self.host_fit.state_bytes == state):
            return
        fit = fit_host_memory(self.config, state, ranks_per_machine(self.coordinator.hosts))
        assert fit is not None
        retention, arena = self.services.retention, self.services.pool.arena
        for tier, keep_last in fit.keep_last.items():
            retention.rules[tier] = dataclasses.replace(retention.rules[tier], keep_last=keep_last)
            if arena is not None and arena.name == tier:
                arena.keep_last = keep_last
        if fit.lowered and self.coordinator.rank == 0:
            log.warning("host_memory %s shared by %d rank(s) of a machine, a state of %s per rank: the memory tier(s) "
                        "keep %s checkpoint(s) (keep_last lowered to fit)", format_size(fit.budget), fit.ranks,
                        format_size(state), ", ".join(f"{t} {fit.keep_last[t]}" for t in fit.lowered))
        self.host_fit = fit

    async def _remove_lost(self) -> None:
        """Checkpoints a load found lost (parts gone from every tier; [engine] on_lost) go before this save, on every
        rank at once (a collective: rank 0 removes, the others wait), so the run can save their steps again and no
        later load picks them. Tried once: an index that cannot list them now leaves them listed (the next load
        finds them lost again), and saving one of their steps again is refused as before."""
        lost = sorted(self.services.lost)
        self.services.lost.clear()

        async def remove() -> list[int] | None:
            try:
                listed = {s.step: s for s in await self.services.removal.index.list(self.job)}
            except TieredCkptError as e:
                log.warning("lost checkpoint(s) %s not removed: the index cannot list them now (%s: %s)", lost,
                            type(e).__name__, e)
                return None
            for step in lost:
                if step in listed:
                    try:
                        await self.services.removal.forget(listed[step])
                    except TieredCkptError as e:  # out of the index and buried: the next writer or gc finishes it
                        log.warning("removing lost checkpoint %d: %s", step, e)
            return lost

        removed = await self.coordinator.on_first(remove, "removing lost checkpoints")
        if removed:
            if self.coordinator.rank == 0:
                log.warning("job %r: removed lost checkpoint(s) %s (their parts are gone from every tier)", self.job,
                            removed)
            self.services.committed.difference_update(removed)

    async def _check_new(self, step: int) -> None:
        if await self.services.is_saved(step):
            raise CheckpointExists(f"job {self.job!r} step {step} already exists; delete it to save it again")

    def raise_unobserved(self, *, closing: bool = False) -> None:
        """Raise (once) what stops training (save/failures.py): a required tier failed, or nothing durable was
        written for `stop_after_failed_saves` saves in a row. At close, also the last save when it committed on no
        tier and nobody waited on it: the run would end believing its last state saved."""
        stop = self.failures.take_stop()
        if stop is not None:
            raise stop
        last = self._newest
        if closing and last is not None and not self.jobs and not last.observed and last.errors \
                and not last.committed_on:
            last.observed = True
            raise SaveError(last.step, last.errors, reason="the last save of the run committed on no tier")

    async def wait_all(self) -> None:
        """Wait until every save in flight has finished on every tier (errors stay in the handles), those
        still starting too (called before close() began: close() refuses later ones)."""
        async with self.starting:
            pass
        while self.jobs:
            await asyncio.wait([j.task for j in self.jobs if j.task is not None])

    async def _failed_before_plan(self, step: int, targets: list[str], error: BaseException) -> BaseException:
        """This rank cannot save its state: make the save fail on every rank, in bounded time. On a first
        save the other ranks wait in the plan gather, which this rank joins with its error; with cached
        plans they run no collective, so the failure is recorded on each target tier, where their commit
        wait sees it (RankFailed naming this rank, instead of a timeout)."""
        await self.planner.join_failed(error)  # raises RankFailed on every rank when it joined the gather
        for tier in targets:
            await self.services.commit.fail_tier(step, tier, error)
        return RankFailed(f"step {step}: rank {self.coordinator.rank} failed before the save was planned: "
                          f"{type(error).__name__}: {error}")

    def _finished(self, job: SaveJob) -> None:
        self.jobs.remove(job)
        if job.task is not None and job.task.cancelled() and self._is_open():
            message = (f"the save of step {job.step} (job {self.job!r}) was cancelled before it finished: was the "
                       f"event loop shut down without `await engine.close()`? Use `async with Engine(...)`")
            log.error(message)
            warnings.warn(message, ResourceWarning, stacklevel=2)
        self.busy.saved(job.step)
        self.failures.finished(job.handle)


def _close_and_wait(launch: Launch) -> None:
    launch.close()
    launch.synchronize()


def _walk(state: Any, allow_pickle: bool, rank: int, launch: Launch | None) -> FlatState:
    if launch is None:
        return flatten(state, allow_pickle=allow_pickle, rank=rank)
    launch.start()
    return flatten(state, allow_pickle=allow_pickle, rank=rank, on_tensor=launch.on_tensor,
                   on_state_dict=launch.on_state_dict)


def _checked_metadata(metadata: dict[str, Any] | None) -> dict[str, Any]:
    if metadata is not None and not isinstance(metadata, Mapping):
        raise StateError(f"metadata must be a dict (msgpack-able), not {type(metadata).__name__}")
    metadata = dict(metadata or {})
    try:
        msgpack.packb(metadata)
    except (TypeError, ValueError) as e:
        raise StateError(f"metadata must be msgpack-able: {e}") from None
    return metadata
