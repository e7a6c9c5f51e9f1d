"""The engine with a Redis peer-cache tier, against real redis-server processes that die, restart empty
or evict."""
import asyncio

import torch

import tiered_ckpt as tc
from tiered_ckpt.config import parse_config


def stack(tmp_path, shm_dir, urls, **peer):
    return parse_config({
        "engine": {"job": "redis", "index": f"file://{tmp_path}/index", "part_size": "64KiB"},
        "tiers": [
            {"name": "host", "kind": "memory", "path": str(shm_dir / "host")},
            {"name": "peer", "kind": "redis", "urls": urls, "retries": 1, **peer},
            {"name": "disk", "kind": "local", "path": str(tmp_path / "disk")},
        ]})


def state(value: float) -> dict:
    return {"w": torch.full((200_000,), value), "b": torch.full((100,), value)}


async def load(engine, **kw):
    out = state(0.0)
    info = await engine.load(out, **kw)
    return info, out


async def test_round_trip_through_the_peer_tier(tmp_path, shm_dir, redis_server):
    async with tc.Engine(stack(tmp_path, shm_dir, [redis_server().url])) as engine:
        await (await engine.save(1, state(1.0))).wait()
        info, out = await load(engine, tiers=["peer"])
        assert info.tier == "peer" and not info.fallbacks and torch.all(out["w"] == 1.0)


async def test_server_killed_mid_save_fails_only_that_tier(tmp_path, shm_dir, redis_server):
    server = redis_server()
    async with tc.Engine(stack(tmp_path, shm_dir, [server.url])) as engine:
        await (await engine.save(1, state(1.0))).wait()
        server.stop()
        handle = await engine.save(2, state(2.0))  # training is not blocked: save() returns after staging
        await handle.wait("host")
        await handle.wait("disk")
        try:
            await handle.wait("peer")
        except tc.TierUnavailable as e:
            assert server.url in str(e) and "peer" in str(e)
        else:
            raise AssertionError("the peer tier cannot have completed with its server dead")
        status = await engine.status(2)
        assert status.complete == {"host", "disk"} and "peer" in status.failed
        info, out = await load(engine)
        assert info.step == 2 and torch.all(out["w"] == 2.0)


async def test_server_restarted_empty_falls_back_to_disk(tmp_path, shm_dir, redis_server):
    server = redis_server()
    async with tc.Engine(stack(tmp_path, shm_dir, [server.url])) as engine:
        await (await engine.save(1, state(1.0))).wait()
        server.stop()
        server.start()  # same port, no data
        info, out = await load(engine, tiers=["peer", "disk"])
        assert torch.all(out["w"] == 1.0) and info.tier == "disk"
        assert info.fallbacks and all(f.tier == "peer" and "TierNotFound" in f.reason for f in info.fallbacks)


async def test_evicting_server_falls_back_per_part(tmp_path, shm_dir, redis_server):
    server = redis_server("--maxmemory", "3mb", "--maxmemory-policy", "allkeys-lru")
    async with tc.Engine(stack(tmp_path, shm_dir, [server.url])) as engine:
        for step in range(1, 5):  # ~800 KiB each: the oldest get evicted
            await (await engine.save(step, state(float(step)))).wait()
        info, out = await load(engine, step=1, tiers=["peer", "disk"])
        assert torch.all(out["w"] == 1.0)
        assert any(f.tier == "peer" for f in info.fallbacks)
