"""gc and long listings at a long history leave the event loop alone: the per-key work (decoding ten thousand
Redis summaries, sorting a tier's keys by step) runs in a thread, and Python's automatic collection is off while
it does. A full collection set off by that work holds the GIL, so every thread waits on it, the event loop
included: an in-process gc at 10,000 checkpoints on Redis stalled the loop for up to 2 s that way."""
import asyncio
import gc
import threading

import pytest

import tiered_ckpt as tc
from tiered_ckpt.layout import manifest_key

from .common import state_of

HISTORY = 1000


@pytest.fixture
def collections_off_the_loop():
    """Automatic collections started in a thread other than the one the test's event loop runs in."""
    seen: list[int] = []
    loop_thread = threading.get_ident()

    def note(phase, info):
        if phase == "start" and threading.get_ident() != loop_thread:
            seen.append(info["generation"])

    gc.collect()
    gc.callbacks.append(note)
    try:
        yield seen
    finally:
        gc.callbacks.remove(note)


async def fill(engine: tc.Engine, steps: range) -> None:
    """Complete checkpoints on the disk tier with a key there for each (what gc sorts by step), recorded through
    the index's own calls."""
    index, job = engine.store.index, engine.store.job
    driver = engine.store.io.driver("disk")
    for step in steps:
        await index.begin(job, step, ["disk"], {"nbytes": 1, "metadata": {"loss": 1.0}})
        assert await index.mark_durable(job, step, "disk", 0, 1, "filled")
        await driver.write(manifest_key(job, step), memoryview(b"m"))


async def test_gc_decodes_a_long_history_off_the_loop_with_collection_off(make_config, redis_server,
                                                                          collections_off_the_loop):
    """Failed on the old code: the Redis summaries were decoded and gc's tier keys sorted in a thread with
    automatic collection on, and 20-odd collections started there (older generations too, each one every
    thread waits on; at 10,000 checkpoints full ones of 0.1-0.2 s each)."""
    config = make_config(index=redis_server().url, tiers=[{"keep_last": 2}, {"keep_last": 2, "keep_every": 1}])
    async with tc.Engine(config) as engine:
        await (await engine.save(1, state_of(1.0))).wait()
        await fill(engine, range(10, 10 * (HISTORY + 1), 10))
        assert gc.isenabled()
        collections_off_the_loop.clear()
        listed = await engine.store.index.list(engine.store.job)
        await engine.gc(dry_run=True)
        await asyncio.sleep(0)
        assert len(listed) == HISTORY + 1
        # the work runs with collection off; each pause may end with one young collection, of what it kept
        assert len(collections_off_the_loop) <= 4 and set(collections_off_the_loop) <= {0}, collections_off_the_loop
        assert gc.isenabled()
