"""The Redis peer-cache tier against real redis-server processes."""
import asyncio

import pytest
import redis
import redis.asyncio as aioredis

from tiered_ckpt.errors import ConfigError, TierFull, TierNotFound, TierUnavailable
from tiered_ckpt.layout import PartKey
from tiered_ckpt.testing import TierConformance, payload
from tiered_ckpt.storage.tiers.redis_peer import RedisOptions, RedisPeerTier


async def connect(urls, **kw):
    tier = RedisPeerTier("peer", RedisOptions(urls=tuple(urls), **kw))
    await tier.open()
    return tier


class TestRedisTier(TierConformance):
    @pytest.fixture
    def make_tier(self, redis_server):
        url = redis_server().url
        return lambda: RedisPeerTier("peer", RedisOptions(urls=(url,), chunk_size=100_000))  # values span chunks


async def test_ring_placement_and_fallback_to_other_servers(redis_server):
    a, b = redis_server(), redis_server()
    node0 = await connect([a.url, b.url], node=0)
    node1 = await connect([a.url, b.url], node=1)
    key = PartKey("job", 1, 0, 0).path
    await node0.write(key, memoryview(b"from node 0"))
    server_a, server_b = aioredis.Redis.from_url(a.url), aioredis.Redis.from_url(b.url)
    assert await server_b.exists(node0.options.prefix + key)  # node 0 writes to node 1's server
    assert not await server_a.exists(node0.options.prefix + key)
    await server_a.aclose()
    await server_b.aclose()
    assert await node1.read(key) == b"from node 0"  # found by the other node too (ring search)
    a.stop()  # node 0's own server dies: its parts, on node 1's server, survive
    assert await node0.read(key) == b"from node 0"
    for t in (node0, node1):
        await t.close()


async def test_unreachable_server_is_retryable_and_names_tier_and_server(redis_server):
    server = redis_server()
    tier = await connect([server.url])
    server.stop()
    with pytest.raises(TierUnavailable) as err:
        await tier.write("job/x", memoryview(b"abc"))
    assert "peer" in str(err.value) and server.url in str(err.value) and err.value.retryable
    await tier.close()


async def test_evicted_chunk_is_detected_as_not_found(redis_server):
    tier = await connect([redis_server().url], chunk_size=1000)
    key = PartKey("job", 1, 0, 0).path
    data = payload(5000)
    await tier.write(key, memoryview(data))
    server = aioredis.Redis.from_url(tier.options.urls[0])
    chunk = [k async for k in server.scan_iter(match="*#*")][2]
    assert await server.delete(chunk) == 1  # what maxmemory eviction does
    await server.aclose()
    with pytest.raises(TierNotFound, match="evicted"):
        await tier.read_into(key, [memoryview(bytearray(5000))])
    await tier.close()


async def test_maxmemory_refusal_is_tier_full(redis_server):
    tier = await connect([redis_server("--maxmemory", "2mb", "--maxmemory-policy", "noeviction").url])
    with pytest.raises(TierFull, match="out of memory"):
        for i in range(20):
            await tier.write(f"job/{i}", memoryview(bytes(500_000)))
    await tier.close()


def test_chunk_size_above_redis_limit_is_a_config_error():
    with pytest.raises(ConfigError, match="512 MiB"):
        RedisPeerTier("peer", RedisOptions(urls=("redis://x",), chunk_size=600 * 2**20))


# A hung server (SIGSTOP: its port open, nothing answering). The socket timeout is the default; a probe that
# does not answer costs PROBE, so BOUND (a few probes, with room for a loaded machine) stays far below it.
PROBE, SOCKET = 1.5, 30.0
BOUND = 4 * PROBE + 3.0


async def within(seconds, awaitable):
    try:
        return await asyncio.wait_for(awaitable, seconds)
    except asyncio.TimeoutError:
        raise AssertionError(f"took longer than {seconds} s (socket_timeout {SOCKET} s)") from None


async def test_a_hung_sole_server_fails_in_a_probe_timeout_not_a_socket_timeout(redis_server):
    """A ring of one whose server hangs: each operation of a process that opens the tier then fails
    (retryably, naming the server) after a PING that got no answer, not after socket_timeout (before:
    2 x socket_timeout each, redis-py's Retry retrying the timeout once)."""
    server = redis_server()
    writer = await connect([server.url])
    await writer.write("job/x", memoryview(b"abc"))
    await writer.close()
    tier = await connect([server.url], probe_timeout=PROBE, socket_timeout=SOCKET)
    try:
        with server.frozen():
            for op in (tier.write("job/y", memoryview(b"abc")), tier.read("job/x"), tier.list("job/")):
                with pytest.raises(TierUnavailable) as err:
                    await within(BOUND, op)
                assert server.url in str(err.value) and "PING" in str(err.value) and err.value.retryable
        assert await tier.read("job/x") == b"abc"  # back: it answers at once
    finally:
        await tier.close()


async def test_a_hung_server_of_the_ring_costs_one_shared_probe_then_is_skipped_by_every_rank(redis_server):
    """Node 0's successor (urls[1]) hangs. Two ranks of node 0 (a driver each) write and read at once: the
    ring skips the hung server for both, to the same next server, and many concurrent reads wait for one PING
    between them; within down_seconds the verdict stands (no second probe: the next reads take less than one
    probe's time). Before: every call waited 2 x socket_timeout."""
    servers = [redis_server() for _ in range(3)]
    urls = [s.url for s in servers]
    ranks = [await connect(urls, node=0, probe_timeout=PROBE, socket_timeout=SOCKET) for _ in range(2)]
    data = {f"job/{r}/{i}": payload(300_000 + i) for r in range(2) for i in range(8)}
    try:
        with servers[1].frozen():
            writes = [t.write(k, memoryview(v)) for r, t in enumerate(ranks) for k, v in data.items()
                      if k.startswith(f"job/{r}/")]
            await within(BOUND, asyncio.gather(*writes))
            reads = [t.read(k) for t in ranks for k in data]
            assert await within(BOUND, asyncio.gather(*reads)) == [v for _ in ranks for v in data.values()]
            started = asyncio.get_running_loop().time()
            await asyncio.gather(*(t.read(k) for t in ranks for k in data))
            assert asyncio.get_running_loop().time() - started < PROBE  # the verdict is cached: no PING waited
        held = [{k.decode() for k in redis.Redis(port=s.port).keys("*")} for s in (servers[0], servers[2])]
        assert not held[0] and {ranks[0].options.prefix + k for k in data} <= held[1]  # the next server, not own
    finally:
        for t in ranks:
            await t.close()
