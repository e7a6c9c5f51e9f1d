"""Checkpointer: the Engine's API for ordinary (non-async) training loops.

One background thread runs a uvloop event loop that owns the Engine; each method submits a coroutine
to it and blocks on the concurrent future (save blocks only until the tensors are staged).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from typing import Any, Callable, Coroutine, Sequence, TypeVar

import uvloop

from .config import Config, load_config
from .engine import Engine
from .load.export import ExportInfo
from .lifecycle.gc import GRACE, GcReport
from .storage.index import CheckpointStatus
from .load.heal import HealReport
from .load.reads import LoadInfo
from .manifest import Manifest
from .save.reserve import Reservation
from .save.handle import SaveHandle, TierDone
from .save.copy import producer_events

T = TypeVar("T")


class SyncSaveHandle:
    """Blocking view of a SaveHandle. `future` completes (or fails) when every targeted tier is done."""

    def __init__(self, handle: SaveHandle, checkpointer: "Checkpointer"):
        self._handle = handle
        self._ckpt = checkpointer
        self.step = handle.step
        self.tiers = handle.tiers
        self._future: concurrent.futures.Future[None] | None = None

    def staged(self, timeout: float | None = None) -> None:
        """Block until the tensors are copied (a lazy save): the state may change after this."""
        self._ckpt._run(self._handle.staged(), timeout)

    def wait(self, tier: str | None = None, timeout: float | None = None) -> None:
        """Block until every targeted tier (or `tier`) is done; raises the save's error."""
        self._ckpt._run(self._handle.wait(tier), timeout)

    def done(self) -> bool:
        """Whether every targeted tier is done (without blocking)."""
        return self._handle.done()

    def on_tier_done(self, callback: Callable[[TierDone], None]) -> None:
        """SaveHandle.on_tier_done without blocking: `callback(TierDone)` once per tier as it finishes. It runs on
        the Checkpointer's event-loop thread, so it must be quick, thread-safe, and call no Checkpointer method."""
        self._ckpt._loop.call_soon_threadsafe(self._handle.on_tier_done, callback)

    @property
    def skipped(self) -> dict[str, int]:
        """Tiers that skipped this save because a newer one superseded it there → that newer step."""
        return dict(self._handle.skipped)

    @property
    def future(self) -> concurrent.futures.Future[None]:
        """A future that completes (or fails) when every targeted tier is done."""
        if self._future is None:
            self._future = asyncio.run_coroutine_threadsafe(self._handle.wait(), self._ckpt._loop)
        return self._future

    def __repr__(self) -> str:
        return f"<SyncSaveHandle step={self.step} tiers={list(self.tiers)} done={self.done()}>"


log = logging.getLogger(__name__)
STOP_GRACE = 10.0  # seconds the loop's pending work gets to unwind at close()


class Checkpointer:
    """The Engine for an ordinary (blocking) training loop: the same methods, run on an event loop of its own
    in a background thread. Use it as a context manager, or call close()."""

    def __init__(self, config: Config):
        self._loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tiered_ckpt-loop", daemon=True)
        self._thread.start()
        try:
            self.engine: Engine = self._run(self._open(config))
        except BaseException:
            self._stop()
            raise
        self.engine.policy.arm()  # save_on_sigterm: here, in the caller's thread (the engine opened in the loop's)

    @staticmethod
    async def _open(config: Config) -> Engine:
        return await Engine(config).open()

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str], **overrides: Any) -> "Checkpointer":
        """Open the job a TOML file describes; `overrides` replace `[engine]` keys, e.g. job="gpt"."""
        return cls(load_config(path, **overrides))

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        if threading.current_thread() is self._thread:
            coro.close()  # never started: no "never awaited" warning on top of the error
            raise RuntimeError("Checkpointer methods cannot be called from its own event loop thread")
        return self._submit(coro).result(timeout)

    def _submit(self, coro: Coroutine[Any, Any, T]) -> "concurrent.futures.Future[T]":
        """Start `coro` on the loop and return without waiting (the integrations' background deletes)."""
        if self._loop.is_closed():
            coro.close()
            raise RuntimeError("this Checkpointer is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def save(self, step: int, state: Any, *, lazy: bool = False, metadata: dict[str, Any] | None = None) -> SyncSaveHandle:
        """Blocks until the tensors are staged (lazy=False) and returns; persistence goes on in the background."""
        events = producer_events()  # here, in the training thread, whose streams produce the tensors
        return SyncSaveHandle(self._run(self.engine.save(step, state, lazy=lazy, metadata=metadata,
                                                         ready_events=events)), self)

    def reserve(self, state: Any) -> Reservation:
        """Engine.reserve, blocking: the staging buffers the saves will use, made now (and checked first, with the
        memory tier staging)."""
        return self._run(self.engine.reserve(state))

    def should_save(self, step: int) -> bool:
        """Engine.should_save, blocking: whether to save `step` now by the [engine] rules (the same answer on
        every rank; after a SIGTERM, the save that follows is the last one before the process ends)."""
        return self._run(self.engine.should_save(step))

    def load(self, state: Any, *, step: int | None = None, tiers: Sequence[str] | None = None,
             best: bool = False) -> LoadInfo:
        """Engine.load, blocking: the newest complete checkpoint, `step`, or with best=True the best one."""
        return self._run(self.engine.load(state, step=step, tiers=tiers, best=best))

    def wait_healed(self) -> list[HealReport]:
        """Engine.wait_healed, blocking: wait for the background heals loads started; their reports."""
        return self._run(self.engine.wait_healed())

    def best(self, tiers: Sequence[str] | None = None) -> CheckpointStatus:
        """Engine.best, blocking: the checkpoint load(best=True) takes."""
        return self._run(self.engine.best(tiers))

    def list(self) -> list[CheckpointStatus]:
        """Every checkpoint of the job, oldest first (Engine.list)."""
        async def collect() -> list[CheckpointStatus]:
            return [c async for c in self.engine.list()]
        return self._run(collect())

    def read_manifest(self, step: int, tiers: Sequence[str] | None = None) -> Manifest:
        """Checkpoint `step`'s manifest: its tensors, sizes and the `metadata` given to save()."""
        return self._run(self.engine.read_manifest(step, tiers))

    def export(self, path: str | os.PathLike[str], *, to: str, step: int | None = None, select: str | None = None,
               force: bool = False, progress: Callable[[int, int], None] | None = None) -> ExportInfo:
        """Engine.export, blocking: write a checkpoint as safetensors, torch or dcp (read-only)."""
        return self._run(self.engine.export(path, to=to, step=step, select=select, force=force, progress=progress))

    def delete(self, step: int) -> None:
        """Delete checkpoint `step` from every tier and the index (Engine.delete)."""
        self._run(self.engine.delete(step))

    def gc(self, *, dry_run: bool = False, grace: float = GRACE, other_indexes: bool = False) -> GcReport:
        """Engine.gc, blocking: remove what crashed runs left (dry_run: only report it)."""
        return self._run(self.engine.gc(dry_run=dry_run, grace=grace, other_indexes=other_indexes))

    def on_event(self, callback: Callable[[Any], None]) -> Callable[[], None]:
        """Engine.on_event: `callback(record)` for every save, tier, load and removal record; returns a function
        that stops it. It runs on the Checkpointer's event-loop thread, so it must be quick, thread-safe, and
        call no Checkpointer method."""
        return self.engine.on_event(callback)

    def wait_all(self) -> None:
        """Block until every save in flight is done on every tier it targets."""
        self._run(self.engine.wait_all())

    def close(self, *, raise_errors: bool = True) -> None:
        """Wait for saves in flight, close the engine and stop the loop thread."""
        if self._loop.is_closed():
            return
        try:
            self.engine.policy.disarm()
            self._run(self.engine.close(raise_errors=raise_errors))
        finally:
            self._stop()

    def _stop(self) -> None:
        """Stop the loop thread. Work still running on it (a call the caller stopped waiting for, e.g. on Ctrl+C)
        is cancelled first and given time to unwind, so its cleanup runs (a load's pause of automatic garbage
        collection ends, its buffers go back)."""
        async def cancel_pending() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks, timeout=STOP_GRACE) if tasks else None

        try:
            asyncio.run_coroutine_threadsafe(cancel_pending(), self._loop).result(STOP_GRACE + 5)
        except Exception as e:  # a loop that no longer runs its tasks: stop it anyway
            log.warning("stopping the checkpointer's loop: pending work did not unwind: %s: %s", type(e).__name__, e)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.close(raise_errors=exc_type is None)
