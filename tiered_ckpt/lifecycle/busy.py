"""The one definition of which steps are busy: nothing removes a busy step.

A step is busy while a save of it is in flight (not yet done on every tier it targets) or a load, an export
or a verify is reading it.
"""
from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from typing import Iterator, Protocol


class InFlight(Protocol):
    def done(self) -> bool: ...
    def done_except(self, tier: str) -> bool: ...


class BusySteps:
    """Saves in flight (tracked until their handle is done on every tier) and reads of a step."""

    def __init__(self) -> None:
        self._saves: dict[int, InFlight] = {}
        self._loads: Counter[int] = Counter()

    def saving(self, step: int, handle: InFlight) -> None:
        self._saves[step] = handle

    def saved(self, step: int) -> None:
        self._saves.pop(step, None)

    @contextmanager
    def loading(self, step: int) -> Iterator[None]:
        self._loads[step] += 1
        try:
            yield
        finally:
            self._loads[step] -= 1
            if not self._loads[step]:
                del self._loads[step]

    def steps(self, *, finishing_on: str | None = None, finishing: frozenset[int] | set[int] = frozenset()) -> set[int]:
        """Busy steps. A save in `finishing` whose only unfinished tier is `finishing_on` (it is running the
        retention pass of that tier) does not count: nothing else of it still reads or writes."""
        busy = {s for s, h in self._saves.items()
                if not h.done() and not (s in finishing and finishing_on is not None and h.done_except(finishing_on))}
        return busy | set(self._loads)
