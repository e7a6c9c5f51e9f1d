"""The engine with a Redis peer-cache tier, against real redis-server processes that die, restart empty
or evict."""

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
            handle = await engine.save(step, state(float(step)))
            await handle.wait("disk")
            try:
                await handle.wait("peer")
            except tc.TierNotFound as e:  # its own parts evicted before the commit: rightly not committed
                assert "vanished before the commit" in str(e)
        assert "peer" in (await engine.status(1)).complete  # committed while it still fitted
        info, out = await load(engine, step=1, tiers=["peer", "disk"])
        assert torch.all(out["w"] == 1.0)
        assert any(f.tier == "peer" for f in info.fallbacks)


async def test_server_restarted_empty_mid_save_never_commits_that_tier(tmp_path, shm_dir, redis_server, monkeypatch):
    server = redis_server()
    async with tc.Engine(stack(tmp_path, shm_dir, [server.url], workers=1)) as engine:
        peer = engine.io.driver("peer")
        write, calls = peer.write, []

        async def write_then_restart(key, data):
            await write(key, data)
            calls.append(key)
            if len(calls) == 2:  # the server restarts, empty, in the middle of the save
                server.stop()
                server.start()

        monkeypatch.setattr(peer, "write", write_then_restart)
        handle = await engine.save(1, state(1.0))
        await handle.wait("disk")
        try:
            await handle.wait("peer")
        except tc.TierNotFound as e:
            assert "vanished before the commit" in str(e)
        else:
            raise AssertionError("the peer tier must not commit parts that a restart lost")
        status = await engine.status(1)
        assert "peer" not in status.complete and status.complete == {"host", "disk"}


async def test_missing_reports_lost_headers_and_chunks(redis_server):
    from tiered_ckpt.storage.tiers.redis_peer import RedisOptions, RedisPeerTier

    tier = RedisPeerTier("peer", RedisOptions(urls=(redis_server().url,), chunk_size=100))
    await tier.open()
    for key in ("j/a", "j/b", "j/c"):
        await tier.write(key, memoryview(bytes(250)))
    await tier._clients[0].delete("tiered_ckpt:j/a")
    chunk = [k async for k in tier._clients[0].scan_iter(match="tiered_ckpt:j/b#*")][0]
    await tier._clients[0].delete(chunk)
    assert await tier.missing(["j/a", "j/b", "j/c"]) == ["j/a", "j/b"]
    await tier.close()
