"""Per-tensor structures (lists and dicts of 100k-1M entries) emptied in a worker thread, a bounded batch at a time.

Freeing is work the interpreter does while it holds the GIL, and a thread gives the GIL back only between
bytecodes, never inside one C call. So the last reference to a dict of 1M entries dropped on the event loop stalls
it for the whole teardown, and dropped in a worker thread as one `clear()` it stalls the loop just as long (a
thread that holds the GIL holds up the loop too). Here each batch is one short C call: a thread that empties a
structure of 1M entries lets the loop run between batches (docs/benchmarks.md, *Event-loop stalls against the
tensor count*).
"""
from __future__ import annotations

import asyncio
from typing import Any, Protocol

BATCH = 2048  # entries freed per C call: ~0.1-0.5 ms each, however large the structure


class Releasable(Protocol):
    def release(self) -> None:
        """Empty what it holds per tensor (in a thread: `empty` on each of its large containers)."""


def empty(container: Any) -> None:
    """Empty a list, dict or set BATCH entries at a time (anything else is left as it is)."""
    if isinstance(container, list):
        while container:
            del container[-BATCH:]
    elif isinstance(container, dict):
        while container:
            for _ in range(min(BATCH, len(container))):
                container.popitem()
    elif isinstance(container, set):
        while container:
            for _ in range(min(BATCH, len(container))):
                container.pop()


def release_all(things: list[Any]) -> None:
    """`release()` each of `things` that has one, `empty` the others, then empty the list itself."""
    for thing in things:
        if hasattr(thing, "release"):
            thing.release()
        else:
            empty(thing)
    things.clear()


async def release_off_loop(things: list[Any]) -> None:
    """Empty `things` (and what each holds per tensor) in a worker thread. The caller hands over its last
    references in the list and keeps none, or the objects outlive this and are freed wherever the last one goes."""
    await asyncio.to_thread(release_all, things)
