"""SaveHandle: what a caller of `save()` holds, and how a save's outcome reaches it."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable

from ..errors import SaveError


def _quiet(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()  # mark retrieved; the handle or the engine reports it


def _resolve(fut: asyncio.Future[None], error: BaseException | None) -> None:
    if not fut.done():
        fut.set_exception(error) if error is not None else fut.set_result(None)


@dataclass(frozen=True)
class TierDone:
    """One tier's outcome of one save, as `SaveHandle.on_tier_done` reports it."""

    step: int
    tier: str
    seconds: float | None  # from the save() call until the tier finished (None: no time was recorded)
    error: BaseException | None = None  # the tier failed (a cancelled save: CancelledError)
    superseded_by: int | None = None  # skipped, not an error: a newer save took this tier's turn

    @property
    def committed(self) -> bool:
        """The checkpoint is complete on this tier: a load may take it from there."""
        return self.error is None and self.superseded_by is None


class SaveHandle:
    """Returned by Engine.save. `staged()`: the state may be mutated. `wait()`: every targeted tier done."""

    def __init__(self, step: int, tiers: list[str], *, started: float | None = None,
                 required: frozenset[str] = frozenset()):
        loop = asyncio.get_running_loop()
        self.step = step
        self.tiers = tuple(tiers)
        self.required = required & set(tiers)  # tiers marked `required = true`: their failure fails the save
        self._staged: asyncio.Future[None] = loop.create_future()
        self._done: dict[str, asyncio.Future[None]] = {t: loop.create_future() for t in tiers}
        for f in (self._staged, *self._done.values()):
            f.add_done_callback(_quiet)
        self.observed = False
        self.started = time.perf_counter() if started is None else started  # the save() call (perf_counter)
        self.durable_at: dict[str, float] = {}  # seconds from save() to durable, per tier
        self.skipped: dict[str, int] = {}  # tiers that could not keep up and skipped this save → the newer step
        self.staged_at: float | None = None  # seconds from save() until the copy was done (None: not, or failed)
        self.nbytes = 0  # this rank's bytes of the checkpoint, as each tier holds them (0 until planned)

    async def staged(self) -> None:
        """Return once the tensors are copied to host buffers (raise if staging failed)."""
        await asyncio.shield(self._staged)

    async def copy_ended(self) -> None:
        """Return once staging ended, copied or failed (raises nothing of it)."""
        await asyncio.wait([self._staged])

    async def wait(self, tier: str | None = None) -> None:
        """Wait for one tier, or all. With a tier: raise that tier's error. Without: once every tier is done,
        raise SaveError naming every failed tier when the save failed: it committed on no tier, or a tier marked
        `required` failed. A save complete on some tier while another failed is a checkpoint (a load takes it):
        this returns, and `errors` names the tiers that failed."""
        if tier is not None:  # one tier's outcome: the save's own failure (a required tier's) is still raised later
            if tier not in self._done:
                raise ValueError(f"step {self.step} does not target tier {tier!r} (targets: {list(self.tiers)})")
            await asyncio.shield(self._done[tier])
            return
        self.observed = True
        await self.staged()
        if self._done:
            await asyncio.wait(self._done.values())
        errors = self.errors
        if errors and (not self.committed_on or self.required & set(errors)):
            raise SaveError(self.step, errors)

    def on_tier_done(self, callback: Callable[[TierDone], None]) -> None:
        """Call `callback(TierDone)` once per targeted tier as it finishes (soon, for a tier already finished), on
        the engine's event loop: a training loop learns of each commit without awaiting one. Keep the callback
        quick; what it raises goes to the loop's exception handler, never into the save. Errors it sees still
        count as unobserved until `wait()` raises them."""
        for tier, fut in self._done.items():
            fut.add_done_callback(lambda _, tier=tier: callback(self._tier_done(tier)))

    def _tier_done(self, tier: str) -> TierDone:
        return TierDone(self.step, tier, self.durable_at.get(tier), self.errors.get(tier), self.skipped.get(tier))

    def done(self) -> bool:
        """Whether the copy and every targeted tier are done (success or not)."""
        return self._staged.done() and all(f.done() for f in self._done.values())

    def done_except(self, tier: str) -> bool:
        """Whether everything but `tier` is done."""
        return self._staged.done() and all(f.done() for t, f in self._done.items() if t != tier)

    @property
    def committed_on(self) -> tuple[str, ...]:
        """The tiers the checkpoint is complete on so far: a load may take it from there."""
        return tuple(t for t, f in self._done.items()
                     if f.done() and not f.cancelled() and f.exception() is None and t not in self.skipped)

    @property
    def errors(self) -> dict[str, BaseException]:
        """The tiers that failed so far → their error (a cancelled tier gets a CancelledError)."""
        out: dict[str, BaseException] = {}
        for tier, f in self._done.items():
            if f.cancelled():
                out[tier] = asyncio.CancelledError("the save was cancelled before it finished on this tier")
            elif f.done() and f.exception() is not None:
                out[tier] = f.exception()  # type: ignore[assignment]
        return out

    def set_staged(self, error: BaseException | None = None) -> None:
        """(The engine's) the copy is done, or failed with `error`."""
        if error is None and not self._staged.done():
            self.staged_at = time.perf_counter() - self.started
        _resolve(self._staged, error)

    def settled(self, tier: str) -> None:
        """(The engine's) `tier` is durable, skipped or failed now: `durable_at[tier]`, seconds from save()."""
        self.durable_at[tier] = time.perf_counter() - self.started

    def set_done(self, tier: str, error: BaseException | None = None) -> None:
        """(The engine's) `tier` is done, or failed with `error`."""
        _resolve(self._done[tier], error)

    def set_skipped(self, tier: str, newer: int) -> None:
        """Done on `tier` without writing it: a newer save superseded this one there (not an error)."""
        self.skipped[tier] = newer
        _resolve(self._done[tier], None)

    def cancel(self) -> None:
        """(The engine's, at close) give up every wait still pending."""
        for fut in (self._staged, *self._done.values()):
            fut.cancel()

    def __repr__(self) -> str:
        state = "done" if self.done() else "staged" if self._staged.done() else "staging"
        return f"<SaveHandle step={self.step} tiers={list(self.tiers)} {state}>"
