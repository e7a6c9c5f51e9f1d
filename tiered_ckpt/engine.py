"""Engine: the facade. It opens the job's store (job_store.py: tiers, index, catalog, removal, writer role,
shared with the command line), adds the save and load paths at `open()`, and hands each call to the part
that does it; it does no I/O itself.

Lifecycle: `async with Engine(config) as engine` opens the store; `save` goes to the Saver (save/saver.py),
`load` to the Loader (load/loader.py), `list`/`status`/`read_manifest`/`export`/`delete`/`gc` to the store
once this engine holds the role they need (writer.py); `close` waits for every save in flight, then re-raises
a background error that no one observed.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from enum import Enum
from typing import Any, AsyncIterator, Callable, Mapping, Sequence

from .agent.client import AgentClient
from .checksum import resolve as resolve_checksum
from .config import Config, check_config, load_config
from .distributed.coordinator import Coordinator
from .errors import ConfigError, TieredCkptError
from .job_store import JobStore
from .lifecycle.gc import GRACE, GcReport
from .lifecycle.retention import Retention
from .lifecycle.rules import Rules
from .load.export import ExportInfo
from .load.heal import HealReport
from .load.loader import Loader
from .load.reads import LoadInfo
from .manifest import Manifest
from .observe.events import EventCallback, Events
from .observe.jsonl import JsonLinesFile, log_path
from .save.arena import Arena
from .save.commit import Committer
from .save.reserve import Reservation
from .save.handle import SaveHandle
from .save.job import SaveServices
from .save.mapped import supported as mapped_supported
from .save.plan import Planner
from .save.policy import SavePolicy
from .save.pool import StagingPool
from .save.saver import Saver
from .storage.index import CheckpointStatus


log = logging.getLogger(__name__)


class EngineState(Enum):
    """Where an engine is in its life: only an open one saves and loads; a closing one finishes its saves."""

    NEW = "new"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


class Engine:
    """One job's checkpointing, async: `save()` blocks only for the copy into staging buffers, the tiers
    persist in the background, `load()` restores from the fastest tier that holds the newest complete
    checkpoint. Open it once (`async with Engine(config)` or `await Engine(config).open()`); under
    torch.distributed every rank makes the same calls."""

    def __init__(self, config: Config, *, on_event: EventCallback | None = None):
        check_config(config)  # a Config built in code gets the checks a TOML file gets
        self.config = config
        self.job = config.engine.job
        self.events = Events(self.job)  # records of saves, loads and removals (observe/): on_event, logs, metrics
        self._sinks: list[Callable[[], None]] = []  # closers of the sinks [engine] configured (blocking: in a thread)
        self.metrics_server: Any = None  # observe.prometheus.MetricsServer when [engine] metrics_port serves metrics
        if on_event is not None:
            self.events.subscribe(on_event)
        self.coordinator = Coordinator()  # replaced at open() when a process group exists
        self.store = JobStore(config)  # the job's tiers, index, catalog, removal and writer role
        self.pool = StagingPool(config.engine.max_inflight, gpu_gather=config.engine.gpu_gather)
        self.planner = Planner(config.engine.part_size, self.coordinator)
        self.policy = SavePolicy.of(config.engine)  # should_save: when to save (save/policy.py)
        self._saver: Saver | None = None  # built at open(): they need the rank
        self._agent: AgentClient | None = None  # [engine] agent = "on": the node agent's client
        self._loader: Loader | None = None
        self._state = EngineState.NEW
        self._closing: asyncio.Future[None] | None = None  # close()'s work, once begun (shared by every close())
        self._finishing: asyncio.Future[None] | None = None  # the last save's wait for its tiers before SIGTERM

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str], **overrides: Any) -> "Engine":
        """`overrides` replace `[engine]` keys, e.g. job="gpt"."""
        return cls(load_config(path, **overrides))

    # -- lifecycle -------------------------------------------------------------------------------
    async def open(self) -> "Engine":
        """Start the tiers and the index and (with a process group) join the other ranks; returns self."""
        if self._state is not EngineState.NEW:
            raise RuntimeError(f"engine is {self._state.value}; open it once")
        engine = self.config.engine
        if engine.distributed:  # one rank of the default process group's world, when there is one
            self.coordinator = await Coordinator.create(engine.collective_timeout)
        # else (distributed = false) the single-rank Coordinator from __init__: no process group, no collectives
        self.planner.coordinator = self.policy.coordinator = self.coordinator
        self.policy.arm()  # save_on_sigterm: the SIGTERM handler (from the main thread; tc.Checkpointer arms it)
        store = self.store
        for name in store.io:  # a file tier's capacity bounds this job's bytes, not those of others sharing its folder
            tier = store.io.file_tier(name)
            if tier is not None:
                tier.count_only(Arena.owned_by(self.job))
        await store.open(self.coordinator, reclaim=self._removing)
        self.pool.arena = self._arena()
        await store.note_newest()
        self.events.rank = self.rank
        rules = {t.name: Rules.of(t) for t in self.config.tiers}
        retention = Retention(self.job, store.index, store.removal, store.busy, rules)
        commit = Committer(store.index, self.job, rank=self.rank, world_size=self.world_size,
                           session=self.coordinator.session, timeout=engine.commit_timeout,
                           index_timeout=engine.index_timeout)
        # one algorithm for every rank ("auto" could resolve differently where xxhash is missing on a rank)
        algorithm = await self.coordinator.broadcast_object(resolve_checksum(engine.checksum))
        self._agent = await self._agent_client() if engine.agent != "off" else None
        if self._agent is not None and engine.role != "reader":  # an earlier trainer's drains (a dead agent's,
            # adopted) finish before this engine's first save fences them out; a reader fences nothing
            waited = await self._agent.settle(self.job)
            if waited:
                log.info("the node agent finished %d save(s) of job %s an earlier trainer left", waited, self.job)
            self._agent.warm()  # connected (the agent started) before the first save needs it
        services = SaveServices(store.io, commit, retention, store.removal, self.pool, store.committed,
                                store.is_saved, algorithm,
                                lost=store.lost, drainer=self._agent)
        self._saver = Saver(self.config, self.coordinator, self.planner, store.writer, store.busy, services,
                            is_open=lambda: self._state is EngineState.OPEN)
        self._loader = Loader(store.io, store.catalog, self.coordinator, store.busy,
                              allow_pickle=engine.allow_pickle, heal=engine.heal, lost=store.lost)
        self._state = EngineState.OPEN
        try:
            await self._open_sinks()  # first: a bad events_log fails before anything is fenced or cleaned up
            if engine.role == "writer":  # a second trainer, or a tier it can never write, fails here, not at a save
                await store.writer.become()
            elif engine.role == "auto":  # a reader until its first save: warned, with nothing written
                await store.writer.warn_unwritable()
        except BaseException:
            await self.close(raise_errors=False)
            raise
        return self

    async def _agent_client(self) -> AgentClient | None:
        """[engine] agent = "auto" / "on": the client of this machine's agent (started at the open if none runs), which
        drains the slower tiers once the memory tier committed a save; None when no memory tier is the staging
        buffer (then there is nothing to hand over, and the trainer writes every tier as with agent = "off"), and
        with "auto" where the index has no fencing the agent can act under."""
        from .agent.folder import agent_folder
        from .agent.links import supported_index, tier_tables

        engine = self.config.engine
        why = supported_index(engine.index)
        if why and engine.agent == "auto":
            log.info("the node agent is not used (%s): this trainer writes every tier itself", why)
            return None
        if why:
            raise ConfigError(f"{why}: set agent = \"off\"", key="engine.agent", file=self.config.source)
        if self.pool.arena is None:
            (log.info if engine.agent == "on" else log.debug)(
                "[engine] agent = %r has nothing to drain: no memory tier is the staging buffer", engine.agent)
            return None
        node, num_nodes = await self.coordinator.node()
        index = engine.index
        if index.startswith("file://"):
            index = "file://" + os.path.abspath(index.removeprefix("file://"))
        link = {"index": index, "index_timeout": engine.index_timeout, "commit_timeout": engine.commit_timeout,
                "tiers": tier_tables(list(self.config.tiers), os.getcwd()), "node": node, "num_nodes": num_nodes,
                "io_threads": engine.io_threads, "background_nice": engine.background_nice}
        index_obj, job = self.store.index, self.job

        def lease_fds() -> list[int]:
            fds = getattr(index_obj, "lease_fds", None)
            return fds(job) if fds is not None else []
        slowest = max((t.timeout * (t.retries + 1) for t in self.config.tiers), default=0.0)
        return AgentClient(agent_folder(), link, lease_fds, outcome_timeout=engine.commit_timeout + 2 * slowest)

    async def _removing(self, tier: str, step: int) -> None:
        """A removal of `step` from `tier` starts (Removal's hook): the staging pool takes its buffer back, and
        the removal is recorded."""
        await self.pool.reclaim(tier, step)
        self.events.removed(tier, step)

    async def _open_sinks(self) -> None:
        """[engine] events_log and metrics_port: the JSON-lines file and the Prometheus server (observe/)."""
        engine = self.config.engine
        if engine.events_log is not None:
            path = log_path(engine.events_log, self.rank)
            try:
                sink = await asyncio.to_thread(JsonLinesFile(path).open)
            except OSError as e:
                raise ConfigError(f"cannot append to {path}: {e.strerror or e}", key="engine.events_log",
                                  file=self.config.source) from None
            unsubscribe = self.events.subscribe(sink)
            self._sinks.append(lambda: (unsubscribe(), sink.close()))
        if engine.metrics_port:
            from .observe.prometheus import rank_port, serve

            port = rank_port(engine.metrics_port, engine.metrics_addr)
            if port is None:  # logged: training goes on without metrics, as with a taken port
                return
            try:
                server = serve(self, port, engine.metrics_addr)
            except OSError as e:  # a taken port must not stop training: say so, and go on without metrics
                log.error("metrics are not served: cannot listen on %s:%d ([engine] metrics_port): %s",
                          engine.metrics_addr, port, e)
            else:
                self._sinks.append(server.close)
                self.metrics_server = server

    def _arena(self) -> Arena | None:
        """Stage straight into the memory tier's files when it is first in the stack and keeps every save
        (every = 1) with a bounded keep_last; else anonymous staging buffers."""
        first, engine = self.config.tiers[0], self.config.engine
        tier = self.store.io.file_tier(first.name)
        if not (engine.stage_in_memory_tier and first.kind == "memory" and tier is not None and first.every == 1
                and first.keep_last is not None and mapped_supported(engine.part_size)):
            return None
        return Arena(first.name, tier, Arena.home_for(tier, self.job, self.session, self.rank), engine.part_size,
                     first.keep_last, self.job, keep_best=first.keep_best or 0)  # nothing changes before a first save

    async def close(self, *, raise_errors: bool = True) -> None:
        """Wait for every save in flight, close tiers and index; raise an unobserved background error. From the
        call on, new saves, loads, deletes and the like are refused. The closing is not stopped by a cancel: a
        cancelled close() leaves it running, and a second close() waits for the same closing."""
        if self._state is EngineState.OPEN:
            self._state = EngineState.CLOSING
            self._closing = asyncio.ensure_future(self._shut_down())
        if self._closing is None:  # never opened
            self._state = EngineState.CLOSED
            return
        await asyncio.shield(self._closing)
        if raise_errors and self._saver is not None:
            self._saver.raise_unobserved(closing=True)

    async def _shut_down(self) -> None:
        saver, loader = self._saver, self._loader
        assert saver is not None and loader is not None
        self.policy.disarm()
        await saver.wait_all()
        if self._agent is not None:  # every save's outcomes are in: the agent lets this trainer's link go
            await self._agent.close()
        if self._finishing is not None:  # the last save after SIGTERM (its caller may have cancelled): then the signal
            await self._finishing
        try:
            await loader.wait_healed(timeout=self.config.engine.commit_timeout)  # then cancelled
            await saver.services.commit.close()  # failures still being recorded: the index goes now
            await self.store.close()
            await self.coordinator.destroy()
            await self.pool.clear()
        finally:  # the sinks whatever failed before them: a metrics port must not outlive the engine
            await self._close_sinks()
        self._state = EngineState.CLOSED

    async def _close_sinks(self) -> None:
        """Every sink, each in a thread (stopping the HTTP server waits for its poll, flushing the file writes): one
        that fails is logged and the others are closed all the same, so no port stays open behind it."""
        while self._sinks:
            try:
                await asyncio.to_thread(self._sinks.pop(0))
            except Exception:
                log.exception("closing an observability sink ([engine] events_log or metrics_port) failed")

    def on_event(self, callback: EventCallback) -> Callable[[], None]:
        """Call `callback(record)` with a record of every save (a `TierEvent` as each tier finishes, then a
        `SaveEvent` once every tier is done), every load (`LoadEvent`, failed ones too) and every removal of a
        checkpoint from a tier (`RemovalEvent`), on the engine's event loop; returns a function that stops it.
        Keep it quick (hand work to a thread or a queue); what it raises is logged, never raised into a save or
        a load. The records are built from what the save's handle and the LoadInfo hold: no save waits for one.
        docs/operations.md, *Observability*, describes them, the JSON lines and the Prometheus metrics."""
        return self.events.subscribe(callback)

    async def __aenter__(self) -> "Engine":
        return await self.open()

    async def __aexit__(self, exc_type: Any, *exc: Any) -> None:
        await self.close(raise_errors=exc_type is None)

    async def wait_all(self) -> None:
        """Wait until every save in flight has finished on every tier (errors stay in the handles)."""
        if self._saver is not None:
            await self._saver.wait_all()

    def _check_open(self) -> None:
        if self._state is EngineState.NEW:
            raise RuntimeError("engine is not open yet: use `async with Engine(...)` or `await engine.open()`")
        if self._state is EngineState.CLOSING:
            raise RuntimeError("engine is closing: it takes no more saves or loads (close() waits for the saves "
                               "already in flight)")
        if self._state is not EngineState.OPEN or self._saver is None:
            raise RuntimeError("engine is closed: an engine opens once; make a new Engine (or Checkpointer) to save "
                               "or load again")

    def _save_path(self) -> Saver:
        self._check_open()
        assert self._saver is not None
        return self._saver

    def _load_path(self) -> Loader:
        self._check_open()
        assert self._loader is not None
        return self._loader


    @property
    def rank(self) -> int:
        """This process's rank in the engine's world (0 without torch.distributed)."""
        return self.coordinator.rank

    @property
    def world_size(self) -> int:
        """How many ranks save and load together (1 without torch.distributed)."""
        return self.coordinator.world_size

    @property
    def session(self) -> str:
        """This opening's id, the same on every rank (it names the folder the saves write under)."""
        return self.coordinator.session

    @property
    def incarnation(self) -> str:
        """The folder (inside each step's) that this engine's saves write under: no other opening shares it."""
        return self._save_path().services.commit.incarnation

    @property
    def is_writer(self) -> bool:
        """This engine is the job's writer (it saved, or deleted): it fenced earlier incarnations."""
        return self._saver is not None and self.store.writer.is_writer

    @property
    def saves_in_flight(self) -> int:
        """Saves not yet finished on every tier they target."""
        return len(self._saver.jobs) if self._saver is not None else 0

    # -- save / load -----------------------------------------------------------------------------
    async def save(self, step: int, state: Any, *, lazy: bool = False, metadata: dict[str, Any] | None = None,
                   ready_events: Mapping[Any, Any] | None = None) -> SaveHandle:
        """Stage `state` and persist it in the background as checkpoint `step`.

        Returns once the tensors are copied to host buffers (the caller may mutate them then). With
        lazy=True it returns at once and the copy runs in a thread: await `handle.staged()` before
        anything mutates the tensors (e.g. before optimizer.step()). At most max_inflight saves hold
        staging buffers; a further save waits here for one. CUDA copies wait for `ready_events` (per device,
        from `tiered_ckpt.save.copy.producer_events()` in the thread that runs the training step); by default
        they are recorded here, on the calling thread's current streams. A failure of an earlier save that no
        one waited for is raised here (once), and this save is not started. Saves called at once (from several
        tasks) start one at a time, in call order. A save cancelled once its copy has started (asyncio.wait_for
        timing out, say) raises CancelledError only when the copy is done, and the checkpoint goes on in the
        background, recorded and counted as any save (on_event, should_save's time rule). The save after
        should_save() said yes for a SIGTERM is the last: it waits for every tier, and then the process ends
        (should_save); cancelled, it does so in the background."""
        saver = self._save_path()
        handle = await saver.start(step, state, metadata=metadata, ready_events=ready_events)
        try:
            if not lazy:
                await saver.staged(handle)
        except asyncio.CancelledError:  # the save goes on in the background: it is recorded and counted all the same
            self._began(handle, lazy)
            raise
        if self._began(handle, lazy):
            await asyncio.shield(self._finishing)  # type: ignore[arg-type]  (a cancel here: it goes on)
        return handle

    def _began(self, handle: SaveHandle, lazy: bool) -> bool:
        """Record the save and count it; when should_save said yes for a SIGTERM, it is the last save: start its
        wait for every tier, after which the process ends (a task, so that no cancel of the caller stops it).
        True then."""
        # records it as its tiers finish (a lazy save: with the caller's wait in staged())
        self.events.watch_save(handle, time.perf_counter() - handle.started, lazy=lazy)
        self.policy.saved()
        if not self.policy.last_save_due or (self._finishing is not None and not self._finishing.done()):
            return False
        self._finishing = asyncio.ensure_future(self._finish(handle))
        return True

    async def reserve(self, state: Any) -> Reservation:
        """Make now, before training, the staging buffers the saves of `state` will use: max_inflight, and with
        the memory tier staging its own files also one per checkpoint it keeps (keep_last + keep_best; with
        [engine] host_memory, the keep_last that fits it: Reservation.keep_last, or a ConfigError naming
        engine.host_memory when nothing fits), each allocated and populated (free buffers made for a state of
        another size are dropped first). The first
        saves then block only for their copy. With the memory tier staging, checked first on every rank at once:
        its `capacity` (ConfigError), and the free space of the file system under it for this machine's ranks
        together (`TierFull` naming the tier, the bytes needed and free). Call it on every rank with the state
        you will save (a collective, as save()); it makes this engine the writer, as a save would. With GPU
        tensors it also makes the GPU scratch the small ones are gathered in, and learns where each copy goes,
        so the first save launches its copies during its walk of the state. Returns what it made and the host
        memory the staging holds from now on."""
        return await self._save_path().reserve(state)

    async def should_save(self, step: int) -> bool:
        """Whether the loop should save `step` now, by the `[engine]` rules: `save_every_steps` (step divisible),
        `save_every_seconds` (that long since the last save, by rank 0's clock) and `save_on_sigterm` (a SIGTERM
        reached any rank). Every rank gets the same answer; call it on every rank at the same steps, as save().
        With several ranks and a time or signal rule it is a collective (one small all_reduce). After a SIGTERM,
        the save() that follows waits until the checkpoint is done on every tier it targets, then the process
        ends as the signal would have ended it (the previous SIGTERM handler gets it). See docs/operations.md."""
        self._check_open()
        return await self.policy.should_save(step)

    async def _finish(self, handle: SaveHandle) -> None:
        """The last save before the process ends: wait for every tier (a failure is logged), then let SIGTERM
        take its course."""
        if not handle.tiers:
            log.error("step %d is the save after SIGTERM, but no tier takes that step (their `every`): nothing was "
                      "saved", handle.step)
        try:
            await handle.wait()
            log.warning("step %d is saved on %s; ending the process as SIGTERM asked", handle.step,
                        ", ".join(handle.tiers))
        except TieredCkptError as e:
            log.error("the save of step %d after SIGTERM failed (%s); ending the process as SIGTERM asked",
                      handle.step, e)
        self.policy.finish()

    async def load(self, state: Any, *, step: int | None = None, tiers: Sequence[str] | None = None,
                   best: bool = False) -> LoadInfo:
        """Load the newest complete checkpoint (or `step`; with best=True the best one by the tiers'
        `best_metric`, see best()) into `state` in place.

        Reads each part from the fastest tier on which the checkpoint is complete; a missing part, a
        short read or a checksum mismatch falls back to the next tier (LoadInfo.fallbacks says which).
        `tiers` restricts which tiers may serve, in speed order. A load never changes the index. With several
        ranks it is collective: every rank passes the same step, tiers and best (else a ValueError on every
        rank, naming what each asked for)."""
        loader = self._load_path()
        if step is not None and type(step) is not int:
            raise TypeError(f"load(step=...) takes an int step, not {type(step).__name__} {step!r}")
        if isinstance(tiers, str):
            raise TypeError(f"load(tiers=...) takes a list of tier names, not the string {tiers!r}: "
                            f"tiers=[{tiers!r}]")
        if best and step is not None:
            raise ValueError(f"load(best=True) picks the step itself: give step={step} or best=True, not both")
        started = time.perf_counter()
        try:
            info = await loader.load(state, step=step, tiers=tiers, best=self.store.best_rule() if best else None)
        except Exception as e:
            self.events.load_failed(step, time.perf_counter() - started, e)
            raise
        self.events.loaded(info)
        return info

    async def wait_healed(self) -> list[HealReport]:
        """Wait until the heals that loads started are done; return what each rewrote (one HealReport per load
        since the last call). After a load, every rank puts back in the background the copies of its saved
        rank that the memory tier and the peer ring lost (a replaced node), so a second failure still resumes
        from them; `[engine] heal = false` turns it off. close() waits for them too, up to `commit_timeout`."""
        return await self._load_path().wait_healed()

    async def best(self, tiers: Sequence[str] | None = None) -> CheckpointStatus:
        """The checkpoint load(best=True) takes: the best by the tiers' `best_metric` (lowest with best_mode
        "min", highest with "max") of save()'s metadata, among those complete on `tiers` (default: every
        tier) that can be loaded. IncompleteCheckpoint when none carries the metric; ConfigError when no tier
        names one. No collective: it reads the index (and the tiers' listings) on this process."""
        self._check_open()
        allowed = self.store.io.names if tiers is None else list(tiers)
        return await self.store.catalog.pick(None, allowed, self.store.best_rule())

    # -- what exists -----------------------------------------------------------------------------
    async def statuses(self) -> list[CheckpointStatus]:
        """Every checkpoint of the job: from the index, or, when the index is unreachable, from the
        manifests on the tiers."""
        return await self.store.statuses()

    async def read_manifest(self, step: int, tiers: Sequence[str] | None = None) -> Manifest:
        """The manifest with every rank's checksums: from the index, or else from the first of `tiers`
        (default: every configured tier, fastest first) with a valid copy."""
        return await self.store.read_manifest(step, tiers)

    async def list(self) -> AsyncIterator[CheckpointStatus]:
        """Every checkpoint of this job, oldest first, with the tiers it targets and those it is complete on,
        its size (`nbytes`) and the `metadata` given to save(): both recorded at begin, so no manifest is read
        (but once per checkpoint saved by an earlier release, from the index)."""
        self._check_open()
        for status in await self.store.list():
            yield status

    async def status(self, step: int) -> CheckpointStatus | None:
        """The index's record of checkpoint `step`, or None."""
        self._check_open()
        return await self.store.status(step)

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
        return await self.store.export(os.fspath(path), to=to, step=step, select=select, force=force,
                                       progress=progress)

    # -- changing what exists --------------------------------------------------------------------
    async def delete(self, step: int) -> None:
        """Delete checkpoint `step` from every tier and the index (commit records first)."""
        self._check_open()
        writer = self.store.writer
        if self.config.engine.role == "reader":
            raise ConfigError(f"job {self.config.engine.job!r}: this engine is a reader: it never deletes (nor "
                              f"saves); `tiered-ckpt delete` removes a checkpoint beside a running trainer",
                              key="engine.role", file=self.config.source)
        if not writer.may_delete:  # a writer's act (with several ranks, every rank calls delete)
            async with self._save_path().starting:  # not beside a save becoming the writer too
                await writer.become()
        await self.store.delete(step)

    async def attach(self, *, hold: bool = True) -> bool:
        """Become a cleaner of the job without starting a new incarnation: `delete` and `gc` then change the
        index within the current one, so a trainer that is still running is not fenced out (the CLI's
        `delete` and `gc` do this; a save still fences, as a writer's first save does). Returns True when no
        writer of the job can run meanwhile: this engine is the writer, or the file index's writer lease was
        free (with `hold`, it is held until detach() or close, and a writer's first save waits for it; without,
        only tested). False when one may be running (the lease is held elsewhere; with Redis, always)."""
        self._check_open()
        return await self.store.attach(hold=hold)

    async def detach(self) -> None:
        """The cleaning is done: release what attach() holds (the file index's lease), so a trainer's first
        save does not wait for this engine to close. A writer keeps its lease."""
        self._check_open()
        await self.store.detach()

    async def gc(self, *, dry_run: bool = False, grace: float = GRACE, other_indexes: bool = False,
                 progress: Callable[[int, int], None] | None = None) -> GcReport:
        """Remove what crashed runs left: incomplete checkpoints no save is writing, folders of this index
        other than a step's committed one, tiers a checkpoint never completed on, removals cut short, temp
        files and empty folders older than `grace` seconds; with a writer possibly running (Redis, or the file
        index's lease held), incomplete saves only once they began more than `grace` ago. dry_run reports the
        same and changes nothing. No collectives: call it on one process (once per node for node-local
        tiers). See docs/operations.md."""
        self._check_open()  # a caller's own attach() stays; one taken for this gc ends with it
        return await self.store.gc(dry_run=dry_run, grace=grace, other_indexes=other_indexes, progress=progress)
