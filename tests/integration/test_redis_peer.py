"""The engine with a Redis peer-cache tier, against real redis-server processes that die, restart empty
or evict."""

import asyncio

import torch

import tiered_ckpt as tc
from tiered_ckpt.testing import configs


def stack(tmp_path, shm_dir, urls, **peer):
    return configs.stack(tmp_path, "memory", {"kind": "redis", "urls": urls, "retries": 1, **peer}, "local",
                         shm=shm_dir, job="redis")


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
        peer = engine.store.io.driver("peer")
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

    import redis.asyncio as aioredis

    url = redis_server().url
    tier = RedisPeerTier("peer", RedisOptions(urls=(url,), chunk_size=100))
    await tier.open()
    for key in ("j/a", "j/b", "j/c"):
        await tier.write(key, memoryview(bytes(250)))
    server = aioredis.Redis.from_url(url)  # what eviction or an operator does, on the server itself
    assert await server.delete("tiered_ckpt:j/a") == 1
    chunk = [k async for k in server.scan_iter(match="tiered_ckpt:j/b#*")][0]
    assert await server.delete(chunk) == 1
    await server.aclose()
    assert await tier.missing(["j/a", "j/b", "j/c"]) == ["j/a", "j/b"]
    await tier.close()


async def test_a_dead_server_of_the_ring_is_passed_over_and_said_once_per_outage(tmp_path, shm_dir, redis_server,
                                                                                  caplog):
    """This node's server is urls[0]; its successor dies: every save still completes (the copy goes to the
    next server), and the outage is logged once, not at every retry of the dead server (down_seconds = 0)."""
    import logging

    servers = [redis_server() for _ in range(3)]
    config = stack(tmp_path, shm_dir, [s.url for s in servers], node=0, down_seconds=0)
    async with tc.Engine(config) as engine:
        servers[1].stop()
        with caplog.at_level(logging.WARNING):
            for step in (1, 2, 3):
                await (await engine.save(step, state(float(step)))).wait()
        info, out = await load(engine, tiers=["peer"])
    assert info.step == 3 and torch.all(out["w"] == 3.0)
    said = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]


def test_a_url_is_this_machine_by_its_address_when_no_url_names_it():
    """urls by IP address: the one that is an address of this machine (not loopback) is the node's own server,
    so the ring never puts a copy there."""
    import socket

    from tiered_ckpt.storage.tiers.redis_peer import RedisOptions, RedisPeerTier

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))  # no packet is sent: the kernel picks the outgoing address
        mine = probe.getsockname()[0]
    assert not mine.startswith("127."), "this machine needs a non-loopback address for this test"
    tier = RedisPeerTier("peer", RedisOptions(urls=("redis://203.0.113.7:6380", f"redis://{mine}:6380",
                                                    "redis://203.0.113.9:6380")))
    tier.bind(rank=0, world_size=1, node=0, num_nodes=1)
    assert tier.own == 1 and 1 not in tier.ring()
    loopback = RedisPeerTier("peer", RedisOptions(urls=("redis://127.0.0.10:6380", "redis://127.0.0.11:6380")))
    loopback.bind(rank=0, world_size=1, node=1, num_nodes=2)
    assert loopback.own is None and loopback.ring() == [0]  # loopback is every node's: the node number decides


async def test_the_first_save_after_a_peer_restart_goes_through_on_new_connections(tmp_path, shm_dir, redis_server):
    # retries = 0: the pooled connections the restart broke must not count as a failed try
    server = redis_server()
    async with tc.Engine(stack(tmp_path, shm_dir, [server.url], retries=0)) as engine:
        await (await engine.save(1, state(1.0))).wait()
        server.stop()
        server.start()  # same port, empty: every pooled connection is now a closed socket
        await (await engine.save(2, state(2.0))).wait()  # raised before: "Connection closed by server"
        info, out = await load(engine, tiers=["peer"])
        assert info.step == 2 and torch.all(out["w"] == 2.0) and not info.fallbacks


async def test_a_prefix_with_glob_characters_is_matched_literally_by_retention_and_delete(tmp_path, shm_dir,
                                                                                           redis_server):
    """SCAN MATCH took the prefix "ck[1]:" for a pattern: retention and delete found nothing to remove, and the
    server kept every save (its memory grew without bound)."""
    import redis

    server = redis_server()
    async with tc.Engine(stack(tmp_path, shm_dir, [server.url], prefix="ck[1]:", keep_last=1)) as engine:
        for step in (1, 2, 3):
            await (await engine.save(step, state(float(step)))).wait()
        steps_held = {k.split(b"/")[1] for k in redis.Redis(port=server.port).keys("*")}
        assert len(steps_held) == 1, steps_held  # keep_last = 1
        await engine.delete(3)
    assert redis.Redis(port=server.port).dbsize() == 0


# A hung ring server (SIGSTOP: its port open, nothing answering), with the default socket timeout: a probe that
# gets no answer costs PROBE, so BOUND (a few probes, with room for a loaded machine) stays far below it.
PROBE, SOCKET = 1.5, 30.0
BOUND = 4 * PROBE + 4.0


async def within(seconds, awaitable):
    try:
        return await asyncio.wait_for(awaitable, seconds)
    except asyncio.TimeoutError:
        raise AssertionError(f"took longer than {seconds} s (socket_timeout {SOCKET} s)") from None


def random_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(200_000, generator=g), "b": torch.randn(100, generator=g)}


async def test_a_hung_ring_server_costs_a_load_one_probe_not_two_socket_timeouts(tmp_path, shm_dir, redis_server):
    """Node 0's successor hangs after a save. A new process's load, which reads nothing from the ring, lists
    the peer tier: that costs one PING without an answer, not 2 x socket_timeout (before: its SCAN waited
    socket_timeout, and redis-py's Retry sent it once more)."""
    servers = [redis_server() for _ in range(3)]
    config = stack(tmp_path, shm_dir, [s.url for s in servers], node=0, probe_timeout=PROBE, socket_timeout=SOCKET)
    async with tc.Engine(config) as engine:
        await (await engine.save(1, random_state(1))).wait()
    with servers[1].frozen():
        async with tc.Engine(config) as engine:
            out = {k: torch.zeros_like(v) for k, v in random_state(1).items()}
            info = await within(BOUND, engine.load(out))
            assert info.step == 1 and info.tier == "host"
            assert all(torch.equal(out[k], v) for k, v in random_state(1).items())


async def test_a_hung_ring_server_costs_a_save_one_probe_per_down_seconds(tmp_path, shm_dir, redis_server):
    """Node 0's successor hangs before a process's first save: its saves complete, each within a few probes'
    time (the server is probed again once down_seconds are over, and skipped again), their ring copies on the
    next server, bit-exact from the ring. Before: the writer's probe waited 20 s, then every save after
    down_seconds waited 2 x socket_timeout."""
    import redis

    servers = [redis_server() for _ in range(3)]
    down = 2.0
    config = stack(tmp_path, shm_dir, [s.url for s in servers], node=0, probe_timeout=PROBE, socket_timeout=SOCKET,
                   down_seconds=down)
    with servers[1].frozen():
        async with tc.Engine(config) as engine:
            async def save(step: int) -> None:
                await (await engine.save(step, random_state(step))).wait()

            await within(BOUND, save(1))  # the writer's start writes a probe value to the ring, then the parts
            await asyncio.sleep(down + 0.5)  # its time is over: tried again
            await within(BOUND, save(2))
            out = {k: torch.zeros_like(v) for k, v in random_state(2).items()}
            info = await within(BOUND, engine.load(out, tiers=["peer"]))
            assert info.step == 2 and info.tier == "peer" and not info.fallbacks
            assert all(torch.equal(out[k], v) for k, v in random_state(2).items())
    assert not redis.Redis(port=servers[0].port).keys("*")  # never the writer's own machine
    assert redis.Redis(port=servers[2].port).keys("*")


async def test_a_checkpoint_is_never_taken_for_lost_while_a_ring_server_is_unreachable(tmp_path, shm_dir,
                                                                                       redis_server):
    """Step 1's memory and disk copies are gone; its ring copy is on this node's successor. With that server
    unreachable, what it holds is unknown: even with on_lost = "fresh" the load raises CheckpointLost and removes
    nothing (the server may come back). With the server answering and empty, the step is really lost: FreshStart."""
    import shutil

    import pytest

    servers = [redis_server() for _ in range(2)]
    config = stack(tmp_path, shm_dir, [s.url for s in servers], node=0, down_seconds=60)
    async with tc.Engine(config) as engine:
        await (await engine.save(1, state(1.0))).wait()
    for root in (shm_dir / "host" / "redis", tmp_path / "disk" / "redis"):
        shutil.rmtree(root)
    fresh = config.replace_engine(on_lost="fresh")
    servers[1].stop()
    async with tc.Engine(fresh) as engine:
        with pytest.raises(tc.CheckpointLost):
            await load(engine)
        assert [s.step for s in await engine.statuses() if s.is_complete] == [1]  # nothing removed
    servers[1].start()  # back, and empty: the ring copy is gone for good
    async with tc.Engine(fresh) as engine:
        with pytest.raises(tc.FreshStart):
            await load(engine)
        await (await engine.save(1, state(10.0))).wait()  # the lost step 1 is removed, and saved again
        info, out = await load(engine)
    assert info.step == 1 and torch.all(out["w"] == 10.0)
