"""Python's automatic garbage collection paused while a save or a load does its per-tensor Python work.

A process that holds a state of 100k tensors holds 100k+ objects that Python's collector tracks, and a full
collection walks all of them: 100-170 ms on a 2-core machine, during which every thread waits, the event loop
included. The per-tensor work of a first save (walking the state, planning, making the staging views) and of
a load (pairing each tensor with its saved entry, scattering the reads) allocates enough to set off such a
collection, though almost all of it is freed again when the work is done: measured, each of those operations
stalled the event loop 130-180 ms, and with collections off 15-40 ms (docs/benchmarks.md, *Automatic
collection paused during the per-tensor work*). So automatic collection is off while such work runs, and back
on when the last of it ends (if it was on before): what it allocated and freed is then gone without a
collection. Explicit `gc.collect()` calls still run. Trainers that turn automatic collection off themselves (torchtitan, Megatron-LM) before their first
save or load are left as they are: it stays off. A process forked during a pause (a DataLoader's workers)
starts with collection as it was before the pause.

What the work keeps (a first save's staging views and plan, a load's table: 300k+ tracked objects at 300k
tensors) is young when the pause ends, and the first collection after it (a young one, on whichever thread
allocates next, the loop's most often) walked all of it: 100-120 ms at 300k tensors. So when the last pause
ends, what is young goes straight to the oldest generation (`gc.freeze()` then `gc.unfreeze()`: two list
splices), which only full collections walk, as they would once it had aged there. Not where the process froze
objects of its own (a server that forks workers): unfreezing would hand those back to the collector.
"""
from __future__ import annotations

import contextlib
import gc
import os
import threading
from typing import Iterator

_lock = threading.Lock()
_depth = 0  # blocks running now, in any thread
_was_enabled = False  # automatic collection was on when the first of them began


def _after_fork_in_child() -> None:
    """The child runs none of the parent's blocks: end their pause there (and a lock a parent's thread held)."""
    global _depth, _lock
    _lock = threading.Lock()
    if _depth:
        _depth = 0
        if _was_enabled:
            gc.enable()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def automatic_gc_paused() -> Iterator[None]:
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                _age_young_objects()
                gc.enable()


def _age_young_objects() -> None:
    """Every tracked object into the oldest generation, without a collection (see the module's note)."""
    if gc.get_freeze_count() == 0:
        gc.freeze()
        gc.unfreeze()
