"""Engine.reserve (#30 item 1): every staging buffer the saves will use is made at set-up, checked against the
memory tier's capacity and the free space under it first, and the first saves take those buffers instead of
allocating while training waits."""
import subprocess
import sys
import textwrap

import pytest
import torch

import tiered_ckpt as tc

from .common import wait_until


def state(value: float) -> dict:
    return {"w": torch.full((300_000,), value), "b": torch.full((1000,), value)}


async def test_reserve_makes_every_buffer_the_first_saves_take(make_config):
    async with tc.Engine(make_config(tiers=[{"keep_last": 2}], max_inflight=1)) as engine:
        reserved = await engine.reserve(state(0.0))
        assert reserved.tier == "host" and reserved.made == 2 + 1  # keep_last + max_inflight
        assert reserved.buffers == reserved.made and reserved.host_bytes == reserved.made * reserved.state_bytes
        assert reserved.machine_bytes == reserved.host_bytes and reserved.state_bytes >= 301_000 * 4
        made = {id(b) for b in engine.pool.free}
        assert len(made) == reserved.made
        for step in range(1, 6):
            await (await engine.save(step, state(float(step)))).wait()
            mine = {id(b) for b in (*engine.pool.free, *engine.pool.retained.values())}
            assert mine <= made, f"save {step} made a buffer of its own"
        assert (await engine.reserve(state(0.0))).made == 0  # every buffer exists: nothing more is made
        out = state(0.0)
        assert (await engine.load(out)).step == 5 and torch.all(out["w"] == 5.0)


async def test_reserve_without_the_memory_tier_staging_makes_max_inflight_buffers(make_config):
    async with tc.Engine(make_config(max_inflight=2, stage_in_memory_tier=False)) as engine:
        reserved = await engine.reserve(state(0.0))
        assert reserved.tier is None and reserved.made == 2 and len(engine.pool.free) == 2
        await (await engine.save(1, state(1.0))).wait()
        await wait_until(lambda: engine.pool.held == 0, what="the save giving its buffer back")
        assert len(engine.pool.free) == 2 and engine.pool.buffers == 2  # taken and given back, none made


async def test_a_capacity_too_small_is_refused_at_reserve_naming_the_key(make_config):
    async with tc.Engine(make_config(tiers=[{"keep_last": 2, "capacity": "2MiB"}])) as engine:
        with pytest.raises(tc.ConfigError) as refused:
            await engine.reserve(state(0.0))
        assert "tiers.host.capacity" in str(refused.value) and not engine.pool.free


async def test_a_reader_reserves_nothing(make_config):
    async with tc.Engine(make_config(role="reader")) as engine:
        with pytest.raises(tc.ConfigError, match="engine.role"):
            await engine.reserve(state(0.0))


SMALL_TMPFS = textwrap.dedent("""
    import asyncio, os, subprocess, sys, torch, tiered_ckpt as tc
    from tiered_ckpt.testing.configs import stack
    root = sys.argv[1]
    shm = os.path.join(root, "shm")
    os.makedirs(shm)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", shm], check=True)
    config = stack(root, {"kind": "memory", "keep_last": 2}, "local", shm=shm, job="j")
    async def main():
        async with tc.Engine(config) as engine:
            try:
                await engine.reserve({"w": torch.zeros(300_000)})  # 1.2 MB a buffer, 3 buffers: 3.6 MB > 3 MiB
            except tc.TierFull as e:
                print("TierFull", e, "| files:", sum(len(f) for _, _, f in os.walk(shm)))
            else:
                print("reserved")
    asyncio.run(main())
""")


def test_a_tmpfs_too_small_for_the_buffers_is_refused_at_reserve_naming_tier_and_bytes(tmp_path):
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"needs a private mount namespace (root): {probe.stderr.strip()}")
    run = subprocess.run(["unshare", "--mount", sys.executable, "-c", SMALL_TMPFS, str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    out = run.stdout.strip()
    assert out.startswith("TierFull") and "tier 'host'" in out and "needs 3.45 MiB" in out and "3.00 MiB free" in out, out
    assert out.endswith("files: 0"), out  # no buffer was made


async def test_a_state_of_another_size_gets_buffers_of_its_own_size(make_config):
    async with tc.Engine(make_config(tiers=[{"keep_last": 2}], max_inflight=1)) as engine:
        small = await engine.reserve(state(0.0))
        bigger = {"w": torch.full((600_000,), 0.0), "b": torch.full((1000,), 0.0)}
        reserved = await engine.reserve(bigger)
        assert reserved.made == small.made == 3 and reserved.state_bytes > small.state_bytes
        assert reserved.host_bytes == 3 * reserved.state_bytes  # the small ones are gone, not counted
        assert all(b.capacity == reserved.state_bytes for b in engine.pool.free)
        made = {id(b) for b in engine.pool.free}
        await (await engine.save(1, bigger)).wait()
        assert {id(b) for b in engine.pool.retained.values()} <= made  # save 1 took a reserved buffer


async def test_checkpoints_of_the_old_size_do_not_count_as_buffers_for_a_new_one(make_config):
    async with tc.Engine(make_config(tiers=[{"keep_last": 2}], max_inflight=1)) as engine:
        for step in (1, 2):
            await (await engine.save(step, state(float(step)))).wait()
        assert len(engine.pool.retained) == 2
        bigger = {"w": torch.full((600_000,), 0.0), "b": torch.full((1000,), 0.0)}
        reserved = await engine.reserve(bigger)
        assert reserved.made == 3  # keep_last + max_inflight of the new size: the retained small ones cannot serve
        assert sum(b.capacity == reserved.state_bytes for b in engine.pool.free) == 3
