"""The Redis peer-cache tier against real redis-server processes."""
import pytest
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
