"""Loads from the memory tier verify each part where it lies (a read-only mapping) and copy it once; a part
file that a staging buffer is taking back (retired checkpoint) is never verified and then rewritten under a
reader: the two sides agree through flock (tiers/memory.py, mapped.py)."""
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


async def test_a_load_from_the_memory_tier_maps_parts_instead_of_copying_them_out(make_config, monkeypatch):
    async with tc.Engine(make_config()) as engine:
        await (await engine.save(1, state_of(1.0))).wait()
        host = engine.io.driver("host")

        async def no_copies(key, out):
            raise AssertionError(f"read_into({key}): the memory tier should be read in place")

        monkeypatch.setattr(host, "read_into", no_copies)
        out = state_of(0.0)
        info = await engine.load(out, tiers=["host"])
        assert info.tier == "host" and not info.fallbacks
        assert torch.equal(out["w"], state_of(1.0)["w"]) and torch.equal(out["b"], state_of(1.0)["b"])


async def test_a_part_file_locked_by_its_staging_buffer_is_read_as_a_copy(make_config):
    """While the engine holds a part file exclusively (taking it back to restage it), a reader does not map
    it: it reads a copy, which its checksum then judges like any other read."""
    async with tc.Engine(make_config()) as engine:
        await (await engine.save(1, state_of(1.0))).wait()
        path = engine.io.driver("host").path_of(PartKey("test", 1, 0, 0, engine.incarnation).path)
        fd = os.open(path, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            mapped, _ = await engine.io.driver("host").read_mapped(PartKey("test", 1, 0, 0, engine.incarnation).path,
                                                               lambda view: None)
            assert not mapped
            out = state_of(0.0)
            info = await engine.load(out, tiers=["host"])
            assert torch.equal(out["w"], state_of(1.0)["w"]) and not info.fallbacks
        finally:
            os.close(fd)


async def test_taking_back_a_retired_buffer_waits_for_a_reader_that_maps_its_file(make_config):
    """keep_last = 1: saving step 2 retires step 1 and takes its files back for the next save. A reader holds
    step 1's first part mapped (a shared flock) meanwhile: the take-back waits until the reader is done."""
    async with tc.Engine(make_config(tiers=[{"keep_last": 1}])) as engine:
        await (await engine.save(1, state_of(1.0))).wait()
        key = PartKey("test", 1, 0, 0, engine.incarnation).path
        host = engine.io.driver("host")
        inside, leave = threading.Event(), threading.Event()

        def slow_reader(view):
            before = bytes(view)
            inside.set()
            leave.wait(10)
            return before, bytes(view)  # what it verified, and what it copies after the wait

        reading = asyncio.ensure_future(host.read_mapped(key, slow_reader))
        await asyncio.to_thread(inside.wait, 10)
        saving = asyncio.ensure_future((await engine.save(2, state_of(2.0))).wait())
        await wait_until(lambda: engine.pool.taking_back == 1, what="retention taking back step 1's files")
        assert not saving.done()  # retention's take-back of step 1's files waits for the reader's lock
        leave.set()
        mapped, (before, after) = await reading
        assert mapped and before == after  # not rewritten under the reader
        await saving
        out = state_of(0.0)
        await engine.load(out, tiers=["host"])
        assert torch.equal(out["w"], state_of(2.0)["w"])
