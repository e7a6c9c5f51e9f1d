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


@pytest.mark.parametrize("kind", ["redis", "file"])
async def test_gc_decodes_a_long_history_off_the_loop_with_collection_off(make_config, redis_server, shm_dir, kind,
                                                                          collections_off_the_loop):
    """Failed on the old code: the Redis summaries (file index: the step folders) were read and gc's tier keys
    sorted in a thread with automatic collection on, and 20-odd collections started there (older generations
    too, each one every thread waits on; at 10,000 checkpoints full ones of 0.1-0.2 s each)."""
    url = redis_server().url if kind == "redis" else f"file://{shm_dir}/index"
    config = make_config(index=url, tiers=[{"keep_last": 2}, {"keep_last": 2, "keep_every": 1}])
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


async def test_a_load_lists_a_tiers_job_folder_again_only_once_it_changed(make_config, shm_dir, monkeypatch):
    """Failed on the old code: each load listed the disk tier's job folder (ten thousand step folders at a long
    history: 5 ms a load); now a load while nothing was saved reads it from the last listing, and a step saved
    since (its folder changes the job folder's time) is seen at the next load."""
    from tiered_ckpt.storage.tiers import local

    config = make_config(index=f"file://{shm_dir}/index", tiers=[{"keep_last": 1}, {"keep_last": 20}])
    async with tc.Engine(config) as engine:
        for step in (1, 2, 3):
            await (await engine.save(step, state_of(float(step)))).wait()
        job_folder = str(engine.store.io.driver("disk").root / engine.store.job)
        listed: list[str] = []
        real = local.os.listdir

        def counted(path="."):
            if str(path) == job_folder:
                listed.append(str(path))
            return real(path)

        monkeypatch.setattr(local.os, "listdir", counted)
        assert (await engine.load(state_of(0.0))).step == 3
        first = len(listed)
        for _ in range(3):
            assert (await engine.load(state_of(0.0))).step == 3
        assert len(listed) == first <= 1
        await (await engine.save(4, state_of(4.0))).wait()
        out = state_of(0.0)
        assert (await engine.load(out)).step == 4 and float(out["w"][0]) == 4.0
        assert len(listed) <= first + 1
