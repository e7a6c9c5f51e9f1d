"""TierIO, the only door into a tier: every operation the library makes on a driver carries the tier's
timeout and retries, so a hung store can fail an operation but never block a save, a load or retention."""
import asyncio
import logging

import pytest

import tiered_ckpt as tc
from tiered_ckpt.testing.configs import faults, stack
from tiered_ckpt.storage.tier_io import TierIO

from .common import state_of

# TierIO's operations → the faulty tier's names for them
FAULT_OPS = {"read": "read", "list": "list", "delete": "delete", "missing": "missing", "usage": "usage",
             "debris": "debris", "remove_debris": "debris"}


def io_of(tmp_path, **tier):
    """TierIO over one faulty tier, "disk", under tmp_path (`faults(stack(tmp_path, "faulty"))` controls it)."""
    return TierIO(stack(tmp_path, {"kind": "faulty", **tier}).tiers, 2)


async def test_a_tier_whose_delete_hangs_cannot_block_a_save(make_config, caplog):
    """keep_last = 1 on a disk whose deletes never return: retention's removal of step 1 times out (a named
    TierTimeout, logged), and `handle.wait()` of step 2 returns: the save itself is durable."""
    caplog.set_level(logging.WARNING)
    config = make_config(tiers=[{}, {"kind": "faulty", "keep_last": 1, "timeout": 0.5, "retries": 0}])
    async with tc.Engine(config) as engine:
        await (await engine.save(1, state_of(1.0))).wait()
        faults(config).inject("stall", ops=["delete"])  # until cleared: never
        handle = await engine.save(2, state_of(2.0))
        await asyncio.wait_for(handle.wait(), 60)
        assert "TierTimeout" in caplog.text and "delete test/step-000000000001/" in caplog.text
        assert (await engine.status(2)).complete == {"host", "disk"}


@pytest.mark.parametrize("op, args", [("read", ("k",)), ("list", ("p/",)), ("delete", ("p/",)),
                                      ("missing", (["k"],)), ("usage", ("p/",)), ("debris", ("p/", 1.0)),
                                      ("remove_debris", (["p/x"], 1.0))])
async def test_every_operation_has_the_tiers_timeout_and_retries(tmp_path, op, args):
    io = io_of(tmp_path, timeout=0.2, retries=2, backoff=0.01)
    await io.open(rank=0, world_size=1, node=0, num_nodes=1)
    try:
        faults(stack(tmp_path, "faulty")).inject("stall", ops=[FAULT_OPS[op]])  # until cleared: never
        with pytest.raises(tc.TierTimeout, match="tier 'disk'.*longer than 0.2s") as err:
            await asyncio.wait_for(getattr(io, op)("disk", *args), 30)
        assert "gave up after 3 attempts" in "".join(err.value.__notes__)
        assert io.retried("disk") == 2
    finally:
        await io.close()


async def test_a_retryable_failure_is_retried_and_a_final_one_is_not(tmp_path):
    io = io_of(tmp_path, backoff=0.01)
    await io.open(rank=0, world_size=1, node=0, num_nodes=1)
    try:
        await io.write("disk", "a/b", memoryview(b"value"))
        faults(stack(tmp_path, "faulty")).inject("fail", ops=["read"], count=1)  # a dropped connection, once
        assert await io.read("disk", "a/b") == b"value" and io.retried("disk") == 1  # two attempts
        with pytest.raises(tc.TierNotFound):  # not retryable: one attempt
            await io.read("disk", "a/missing")
        assert io.retried("disk") == 1
    finally:
        await io.close()


def test_file_tiers_are_declared_not_guessed(tmp_path):
    config = stack(tmp_path, {"kind": "memory", "path": str(tmp_path / "shm")}, "local")
    io = TierIO(config.tiers, 1)
    try:
        host, disk = io.file_tier("host"), io.file_tier("disk")
        assert host is not None and host.capacity == 16 * 2**30
        assert disk is not None and disk.capacity is None
        assert host.path_of("job/x") == tmp_path / "shm" / "job" / "x"
    finally:
        io.shutdown()
