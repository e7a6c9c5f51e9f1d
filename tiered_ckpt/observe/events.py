"""The records of what the engine did (a save, one tier of a save, a load, a removal) and the hub that hands
each to the application's callbacks, to the `tiered_ckpt.events` logger as one JSON line, and to the sinks the
engine's configuration adds (a JSON-lines file, Prometheus metrics).

Every record is built from what the SaveHandle and the LoadInfo already hold, when the save or load is done:
nothing here awaits, and nothing on the save() path waits for a record. A callback runs on the engine's event
loop; what it raises is logged, never raised into a save or a load."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import time as _time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Union

if TYPE_CHECKING:
    from ..load.reads import LoadInfo
    from ..save.handle import SaveHandle, TierDone

log = logging.getLogger(__name__)
EVENTS_LOGGER = "tiered_ckpt.events"  # one JSON object per record, at INFO
events_log = logging.getLogger(EVENTS_LOGGER)


@dataclass(frozen=True)
class TierEvent:
    """One tier's outcome of one save, recorded as that tier finishes (so a slow tier does not hold back the
    record of a fast one); the save's `SaveEvent` repeats it once every tier is done. `nbytes` and `seconds`
    are this rank's."""

    kind: ClassVar[str] = "tier"
    job: str  # the engine's job
    rank: int  # this process's rank in the engine's world
    step: int
    tier: str
    outcome: str  # "committed" (a load may take it from there), "skipped" (see superseded_by) or "failed"
    seconds: float | None  # from the save() call until durable (or skipped) on the tier; None when it failed
    nbytes: int  # bytes of this rank's parts the tier holds now: the save's nbytes when committed, else 0
    error: str | None = None  # "TierTimeout: ..." when the tier failed (a cancelled save: "CancelledError: ...")
    superseded_by: int | None = None  # skipped: the newer step that took this tier's turn
    time: float = field(default_factory=_time.time)  # Unix time of the record

    @property
    def committed(self) -> bool:
        """The checkpoint is complete on this tier."""
        return self.outcome == "committed"


@dataclass(frozen=True)
class SaveEvent:
    """One save, recorded once every tier it targets is done (committed, skipped or failed). A save() that
    raises (a bad state, a step that exists) records nothing: its caller has the exception."""

    kind: ClassVar[str] = "save"
    job: str  # the engine's job
    rank: int  # this process's rank in the engine's world
    step: int
    blocked_seconds: float  # the save() call, from its start until it returned (lazy=True: before the copy)
    staged_seconds: float | None  # from save() until the copy into staging buffers was done; None: it failed
    nbytes: int  # this rank's bytes of the checkpoint (one copy)
    tiers: tuple[TierEvent, ...]  # every targeted tier, fastest first; empty when no tier takes the step
    # what the training loop waited for this save: the save() call, and for lazy=True also its wait in staged()
    # (or in wait(), which waits for the copy first) for the copy to end; None: the copy failed
    paused_seconds: float | None = None
    time: float = field(default_factory=_time.time)  # Unix time of the record

    @property
    def ok(self) -> bool:
        """No targeted tier failed (skipped tiers are no failure)."""
        return all(t.outcome != "failed" for t in self.tiers)

    @property
    def committed(self) -> tuple[str, ...]:
        """The tiers the checkpoint is complete on."""
        return tuple(t.tier for t in self.tiers if t.committed)


@dataclass(frozen=True)
class LoadEvent:
    """One load, recorded when it returns or raises. A failed load has `error` (and `step` only when the caller
    asked for one); a first run with nothing saved records an `IncompleteCheckpoint` too."""

    kind: ClassVar[str] = "load"
    job: str  # the engine's job
    rank: int  # this process's rank in the engine's world
    step: int | None  # the checkpoint loaded (failed: the step asked for, if any)
    tier: str | None  # the tier that served the most bytes
    nbytes_by_tier: Mapping[str, int]  # bytes each tier served this rank (every tier that served any)
    seconds: float  # the load() call
    fallbacks: int  # parts the preferred tier could not serve intact, read from a slower one
    bytes_received: int = 0  # bytes this rank got by broadcast from the reader of its replica group
    error: str | None = None  # "IncompleteCheckpoint: ..." when the load raised
    time: float = field(default_factory=_time.time)  # Unix time of the record

    @property
    def nbytes(self) -> int:
        """Bytes read from the tiers by this rank."""
        return sum(self.nbytes_by_tier.values())

    @property
    def tiers(self) -> tuple[str, ...]:
        """The tiers that served bytes, most first."""
        return tuple(sorted(self.nbytes_by_tier, key=lambda t: -self.nbytes_by_tier[t]))


@dataclass(frozen=True)
class RemovalEvent:
    """A checkpoint's data is being removed from one tier by this process: retention (keep_last, keep_best,
    keep_every, room on a full tier), `delete()`, or a writer's cleanup of what a crashed run left. Recorded
    as the removal starts; one that fails is retried later (and recorded again)."""

    kind: ClassVar[str] = "removal"
    job: str  # the engine's job
    rank: int  # this process's rank in the engine's world
    step: int
    tier: str  # the tier it leaves
    time: float = field(default_factory=_time.time)  # Unix time of the record


Event = Union[SaveEvent, TierEvent, LoadEvent, RemovalEvent]
EventCallback = Callable[[Event], None]


def to_dict(event: Event) -> dict[str, Any]:
    """The record as JSON-able values: `{"event": kind, ...fields}`; a save's tiers as an object by tier name."""
    out: dict[str, Any] = {"event": event.kind}
    for f in dataclasses.fields(event):
        name, value = f.name, getattr(event, f.name)
        if name == "tiers":
            value = {t.tier: {k: v for k, v in to_dict(t).items() if k not in ("event", "job", "rank", "step", "tier",
                                                                              "time")} for t in value}
        elif isinstance(value, Mapping):
            value = dict(value)
        elif isinstance(value, float) and not math.isfinite(value):
            value = None
        out[name] = value
    return out


def to_json(event: Event) -> str:
    """One line of JSON (no newline inside)."""
    return json.dumps(to_dict(event), separators=(",", ":"), default=str)


class _PauseClock:
    """How long the training loop waited for one save. A plain save's copy is inside save(); a lazy save's ends
    while the loop runs on, and the loop waits only if it calls staged() before the copy is done. Only the
    caller's call to staged() tells when that is, so this wraps `staged` on that one handle (SaveHandle.wait()
    calls it too) and keeps when it was first called. The record is made once every tier is done, after the
    copy: a staged() not called by then returns at once, so it adds nothing."""

    def __init__(self, handle: "SaveHandle", blocked: float, lazy: bool):
        self.handle, self.blocked = handle, blocked
        self.called_at: float | None = None  # seconds from save() to the first staged() call
        if lazy:
            staged = handle.staged

            async def timed_staged() -> None:
                if self.called_at is None:
                    self.called_at = _time.perf_counter() - handle.started
                await staged()
            setattr(handle, "staged", timed_staged)  # this handle's alone, not the class's

    def paused(self) -> float | None:
        """save() plus the wait in staged() for the copy to end; None when the copy failed. The handle's own
        staged() is back from here on (the copy is over), which also breaks the handle ↔ wrapper cycle."""
        vars(self.handle).pop("staged", None)
        copied = self.handle.staged_at
        if copied is None:
            return None
        if self.called_at is None:
            return self.blocked
        return self.blocked + max(0.0, copied - max(self.called_at, self.blocked))


def _error(e: BaseException | None) -> str | None:
    return None if e is None else f"{type(e).__name__}: {e}"


class Events:
    """The engine's hub: turns a SaveHandle and a LoadInfo into records and hands each to every subscriber, in
    the order they subscribed, and to the `tiered_ckpt.events` logger."""

    def __init__(self, job: str):
        self.job = job
        self.rank = 0  # set at open()
        self._callbacks: tuple[EventCallback, ...] = ()  # replaced, never mutated: emit() may run meanwhile

    def subscribe(self, callback: EventCallback) -> Callable[[], None]:
        """Add a subscriber; returns a function that removes it."""
        if not callable(callback):
            raise TypeError(f"on_event needs a callable, got {callback!r}")
        self._callbacks = (*self._callbacks, callback)

        def unsubscribe() -> None:
            self._callbacks = tuple(c for c in self._callbacks if c is not callback)
        return unsubscribe

    @property
    def listening(self) -> bool:
        return bool(self._callbacks) or events_log.isEnabledFor(logging.INFO)

    def emit(self, event: Event) -> None:
        for callback in self._callbacks:
            try:
                callback(event)
            except Exception:
                log.exception("an on_event callback raised on a %s record (step %s); it was ignored", event.kind,
                              getattr(event, "step", None))
        if events_log.isEnabledFor(logging.INFO):
            events_log.info(to_json(event))

    # -- what the engine reports -----------------------------------------------------------------
    def watch_save(self, handle: "SaveHandle", blocked: float, *, lazy: bool = False) -> None:
        """Record each tier as it finishes, then the save: through the handle's own callbacks (no await, no
        task). `blocked`: how long save() took; `lazy`: save() returned before the copy, so the caller's wait
        for it in staged() is timed too (_PauseClock)."""
        if not self.listening:
            return
        pause = _PauseClock(handle, blocked, lazy)
        if not handle.tiers:
            self.emit(self._save(handle, blocked, (), pause))
            return
        done: dict[str, TierEvent] = {}

        def tier_done(outcome: "TierDone") -> None:
            event = self._tier(handle, outcome)
            done[outcome.tier] = event
            self.emit(event)
            if len(done) == len(handle.tiers):
                self.emit(self._save(handle, blocked, tuple(done[t] for t in handle.tiers), pause))

        handle.on_tier_done(tier_done)

    def _tier(self, handle: "SaveHandle", outcome: "TierDone") -> TierEvent:
        state = "committed" if outcome.committed else "failed" if outcome.error is not None else "skipped"
        return TierEvent(self.job, self.rank, handle.step, outcome.tier, state,
                         None if state == "failed" else outcome.seconds, handle.nbytes if state == "committed" else 0,
                         _error(outcome.error), outcome.superseded_by)

    def _save(self, handle: "SaveHandle", blocked: float, tiers: tuple[TierEvent, ...],
              pause: "_PauseClock") -> SaveEvent:
        return SaveEvent(self.job, self.rank, handle.step, blocked, handle.staged_at, handle.nbytes, tiers,
                         pause.paused())

    def loaded(self, info: "LoadInfo") -> None:
        if self.listening:
            self.emit(LoadEvent(self.job, self.rank, info.step, info.tier,
                                {t: n for t, n in info.bytes_by_tier.items() if n}, info.seconds,
                                len(info.fallbacks), info.bytes_received))

    def load_failed(self, step: int | None, seconds: float, error: BaseException) -> None:
        if self.listening:
            self.emit(LoadEvent(self.job, self.rank, step, None, {}, seconds, 0, error=_error(error)))

    def removed(self, tier: str, step: int) -> None:
        if self.listening:
            self.emit(RemovalEvent(self.job, self.rank, step, tier))
