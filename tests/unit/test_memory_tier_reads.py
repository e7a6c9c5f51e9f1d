"""Loads from the memory tier read each part a chunk at a time, verify the chunk and copy it once, with no
bounce copy of the part; a part file that a staging buffer is taking back (retired checkpoint) is never
rewritten under a reader: the two sides agree through flock (storage/tiers/memory.py, save/mapped.py)."""
import asyncio
import fcntl
import os
import threading

import torch

import tiered_ckpt as tc
from tiered_ckpt.layout import PartKey

from .common import wait_until


def state_of(value: float) -> dict:
    return {"w": torch.full((50_000,), value), "b": torch.arange(7, dtype=torch.int64) + int(value)}


async def test_a_load_from_the_memory_tier_reads_chunks_in_place_of_a_bounce_copy(make_config, monkeypatch):
    async with tc.Engine(make_config()) as engine:
        await (await engine.save(1, state_of(1.0))).wait()
        host = engine.store.io.driver("host")

        async def no_copies(key, out):
            raise AssertionError(f"read_into({key}): the memory tier should be read chunk by chunk")

        monkeypatch.setattr(host, "read_into", no_copies)
        out = state_of(0.0)
        info = await engine.load(out, tiers=["host"])
        assert info.tier == "host" and not info.fallbacks
        assert torch.equal(out["w"], state_of(1.0)["w"]) and torch.equal(out["b"], state_of(1.0)["b"])


async def test_a_part_file_locked_by_its_staging_buffer_is_read_as_a_copy(make_config):
    """While the engine holds a part file exclusively (taking it back to restage it), a reader does not read
    it chunk by chunk: it reads a copy, which its checksum then judges like any other read."""
    async with tc.Engine(make_config()) as engine:
        await (await engine.save(1, state_of(1.0))).wait()
        path = engine.store.io.driver("host").path_of(PartKey("test", 1, 0, 0, engine.incarnation).path)
        fd = os.open(path, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            length = os.path.getsize(path)
            assert await engine.store.io.driver("host").read_chunks(PartKey("test", 1, 0, 0, engine.incarnation).path,
                                                              length, length, lambda chunk, at: True) is None
            out = state_of(0.0)
            info = await engine.load(out, tiers=["host"])
            assert torch.equal(out["w"], state_of(1.0)["w"]) and not info.fallbacks
        finally:
            os.close(fd)


async def test_taking_back_a_retired_buffer_waits_for_a_reader_of_its_file(make_config):
    """keep_last = 1: saving step 2 retires step 1 and takes its files back for the next save. A reader is in
    the middle of step 1's first part (holding a shared flock) meanwhile: the take-back waits until the reader
    is done, so no staging copy can rewrite the file under it."""
    async with tc.Engine(make_config(tiers=[{"keep_last": 1}])) as engine:
        await (await engine.save(1, state_of(1.0))).wait()
        key = PartKey("test", 1, 0, 0, engine.incarnation).path
        host = engine.store.io.driver("host")
        length = os.path.getsize(host.path_of(key))
        inside, leave, seen = threading.Event(), threading.Event(), []

        def slow_reader(chunk, at):
            seen.append(bytes(chunk))
            inside.set()
            leave.wait(10)
            return True

        reading = asyncio.ensure_future(host.read_chunks(key, length, length, slow_reader))
        await asyncio.to_thread(inside.wait, 10)
        saving = asyncio.ensure_future((await engine.save(2, state_of(2.0))).wait())
        await wait_until(lambda: engine.pool.taking_back == 1, what="retention taking back step 1's files")
        # retention's take-back of step 1's files waits for the reader's lock: save 2 stays unfinished (a take-back
        # that did not wait would finish it within milliseconds; 2 s bounds how long that is given)
        finished, _ = await asyncio.wait([saving], timeout=2)
        assert not finished
        leave.set()
        assert await reading == length and len(seen) == 1
        await saving
        out = state_of(0.0)
        await engine.load(out, tiers=["host"])
        assert torch.equal(out["w"], state_of(2.0)["w"])
