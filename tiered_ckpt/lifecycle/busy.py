"""The one definition of which steps are busy: nothing removes a busy step.

A step is busy while a save of it is in flight (not yet done on every tier it targets) or a load, an export
or a verify is reading it. While a load picks its step, retention waits before it removes anything, so the
step picked is never removed between the pick and the load's hold on it; removals already running are named
per (step, tier) (`removals`), so the load reads the step elsewhere.
"""
from __future__ import annotations

import asyncio
from collections import Counter
from contextlib import contextmanager
from typing import Awaitable, Callable, Iterator, Protocol, TypeVar

T = TypeVar("T")


class InFlight(Protocol):
    def done(self) -> bool: ...
    def done_except(self, tier: str) -> bool: ...


class BusySteps:
    """Saves in flight (tracked until their handle is done on every tier) and reads of a step."""

    def __init__(self) -> None:
        self._saves: dict[int, InFlight] = {}
        self._loads: Counter[int] = Counter()
        self._picking = 0  # loads choosing their step: retention waits before a removal
        self._no_picking = asyncio.Event()
        self._no_picking.set()
        self._removing: Counter[tuple[int, str]] = Counter()  # (step, tier) removals running

    def saving(self, step: int, handle: InFlight) -> None:
        self._saves[step] = handle

    def saved(self, step: int) -> None:
        self._saves.pop(step, None)

    @contextmanager
    def loading(self, step: int) -> Iterator[None]:
        self.begin_load(step)
        try:
            yield
        finally:
            self.end_load(step)

    def begin_load(self, step: int) -> None:
        self._loads[step] += 1

    def end_load(self, step: int) -> None:
        self._loads[step] -= 1
        if not self._loads[step]:
            del self._loads[step]

    @contextmanager
    def picking(self) -> Iterator[None]:
        self._picking += 1
        self._no_picking.clear()
        try:
            yield
        finally:
            self._picking -= 1
            if not self._picking:
                self._no_picking.set()

    async def pick_and_hold(self, pick: Callable[[], Awaitable[T]], step_of: Callable[[T], int]) -> tuple[T, set[str]]:
        """Run a read's choice of its step (`pick`) while retention waits, and hold the step picked (busy until
        `end_load`). Returns what `pick` returned, and the tiers a removal of that step runs on (or ran on as
        the pick began): the read takes the step from its other tiers."""
        removals = self.removals()  # those running as the pick begins may end before it does
        with self.picking():
            picked = await pick()
            step = step_of(picked)
            self.begin_load(step)
        return picked, {t for s, t in removals | self.removals() if s == step}

    async def no_load_picking(self) -> None:
        """Return once no load is picking its step (then, before any await, what is busy is known)."""
        while self._picking:  # (an Event's waiters wake for a set() even if a new pick cleared it meanwhile)
            await self._no_picking.wait()

    @contextmanager
    def removing(self, step: int, tier: str) -> Iterator[None]:
        self._removing[step, tier] += 1
        try:
            yield
        finally:
            self._removing[step, tier] -= 1
            if not self._removing[step, tier]:
                del self._removing[step, tier]

    def removals(self) -> set[tuple[int, str]]:
        """Every (step, tier) being removed now."""
        return set(self._removing)

    def steps(self, *, finishing_on: str | None = None, finishing: frozenset[int] | set[int] = frozenset()) -> set[int]:
        """Busy steps. A save in `finishing` whose only unfinished tier is `finishing_on` (it is running the
        retention pass of that tier) does not count: nothing else of it still reads or writes."""
        busy = {s for s, h in self._saves.items()
                if not h.done() and not (s in finishing and finishing_on is not None and h.done_except(finishing_on))}
        return busy | set(self._loads)
