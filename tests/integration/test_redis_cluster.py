"""The Redis index and the Redis peer tier on a real Redis Cluster of 3 masters: the Index conformance suite,
an Engine save/list/load round trip, hash tags (one slot per job, jobs spread over masters), eviction policies
checked on every master, and failures named as what they are (MOVED to a plain redis:// URL, CLUSTERDOWN)."""
import asyncio
import re
import subprocess

import pytest
import redis.asyncio as aioredis
import torch

import tiered_ckpt as tc
from tiered_ckpt.testing import configs
from tiered_ckpt.errors import IndexUnavailable, TierUnavailable
from tiered_ckpt.storage.index.redis import RedisIndex
from tiered_ckpt.testing import IndexConformance, TierConformance
from tiered_ckpt.storage.tiers.redis_peer import RedisOptions, RedisPeerTier

from .redis_deploy import cluster_url, redis_cluster  # noqa: F401  (fixtures)


class TestClusterIndex(IndexConformance):
    @pytest.fixture
    def make_index(self, cluster_url):  # noqa: F811
        return lambda: RedisIndex(cluster_url)


class TestClusterPeerTier(TierConformance):
    large_value = 1_000_000  # 10 chunks of 100 kB, spread over the masters

    @pytest.fixture
    def make_tier(self, cluster_url):  # noqa: F811
        return lambda: RedisPeerTier("peer", RedisOptions(urls=(cluster_url,), chunk_size=100_000))


def stack(tmp_path, shm_dir, index_url, peer_url=None, job="gpt"):
    peer = {"kind": "redis", "urls": [peer_url], "chunk_size": "64KiB", "keep_last": 2}
    return configs.stack(tmp_path, {"kind": "memory", "keep_last": 2}, *([peer] if peer_url else []), "local",
                         shm=shm_dir, job=job, index=index_url)


def state(value: float) -> dict:
    return {"w": torch.full((50_000,), value), "b": torch.arange(1000) * value, "meta": {"step": int(value)}}


async def test_engine_round_trip_on_a_cluster_index_and_peer_tier(tmp_path, shm_dir, cluster_url):  # noqa: F811
    async with tc.Engine(stack(tmp_path, shm_dir, cluster_url, cluster_url)) as engine:
        for step in (1, 2, 3):
            await (await engine.save(step, state(float(step)))).wait()
        listing = {c.step: sorted(c.complete) async for c in engine.list()}
        assert listing == {1: ["disk"], 2: ["disk", "host", "peer"], 3: ["disk", "host", "peer"]}
    async with tc.Engine(stack(tmp_path, shm_dir, cluster_url, cluster_url)) as engine:  # a new process
        for tier in ("peer", "disk", "host"):
            out = state(0.0)
            info = await engine.load(out, tiers=[tier])
            assert info.step == 3 and not info.fallbacks, tier
            assert torch.equal(out["w"], state(3.0)["w"]) and torch.equal(out["b"], state(3.0)["b"])
            assert out["meta"] == {"step": 3}
        await engine.delete(3)
        assert [c.step async for c in engine.list()] == [1, 2]


async def test_a_jobs_keys_share_one_slot_and_jobs_spread_over_the_masters(redis_cluster, cluster_url):  # noqa: F811
    jobs = [f"job{i}" for i in range(12)]
    for job in jobs:
        index = RedisIndex(cluster_url)
        await index.open()
        await index.fence(job)
        await index.begin(job, 1, ["disk"])
        await index.bury(job, 9)
        await index.close()
    owners = {}
    for job in jobs:
        names = [f"tiered_ckpt:idx:{{{job}}}:{k}" for k in ("epoch", "steps", "step:1", "tombstones")]
        nodes = {redis_cluster.node_of(n).port for n in names}
        assert len(nodes) == 1, (job, nodes)  # one slot: one script can commit atomically
        owners[job] = nodes.pop()
        value = subprocess.run(["redis-cli", "-p", str(owners[job]), "hget", names[2], "target:disk"],
                               capture_output=True, text=True).stdout.strip()
        assert value == "0"  # really stored under the hash-tagged name
    assert len(set(owners.values())) > 1  # different jobs land on different masters


async def test_an_evicting_policy_on_any_master_is_refused(redis_cluster, cluster_url):  # noqa: F811
    last = redis_cluster.nodes[-1].port
    client = aioredis.Redis(port=last)
    await client.config_set("maxmemory-policy", "allkeys-lru")
    try:
        index = RedisIndex(cluster_url)
        with pytest.raises(tc.ConfigError, match=rf"master 127\.0\.0\.1:{last}.*allkeys-lru.*noeviction"):
            await index.open()
        await index.close()
    finally:
        await client.config_set("maxmemory-policy", "noeviction")
        await client.aclose()


async def test_a_cluster_node_behind_a_plain_url_is_named_not_shown_as_moved(redis_cluster, cluster_url):  # noqa: F811
    port = redis_cluster.nodes[0].port
    with pytest.raises(tc.ConfigError, match="node of a Redis Cluster: use redis\\+cluster://"):
        await RedisIndex(f"redis://127.0.0.1:{port}/0").open()
    with pytest.raises(tc.ConfigError, match="only database 0"):
        RedisIndex(f"{cluster_url}/3")
    # a server that turns into a cluster node after open: the redirection is named, with the right URL form
    index = RedisIndex(f"redis://127.0.0.1:{port}/0")
    index._check_server = lambda: asyncio.sleep(0)  # as if it had been a plain server at open
    await index.open()
    errors = []
    for job in (f"j{i}" for i in range(10)):
        try:
            await index.fence(job)
        except tc.TieredCkptError as e:
            errors.append(str(e))
    await index.close()
    assert errors, "no job's slot is served elsewhere"
    for message in errors:
        assert "MOVED" in message and "redis+cluster://" in message and "fence" in message
        assert not re.search(r"fence: \d+ 127\.0\.0\.1:\d+", message)  # never the bare redirection


async def test_a_down_slot_is_named_clusterdown_and_the_index_recovers(redis_cluster, cluster_url):  # noqa: F811
    """A master dies (no replica takes over): once the cluster marks its slots failed, every operation says
    CLUSTERDOWN (after retrying for failover_timeout); when the master is back, operations go through."""
    index = RedisIndex(cluster_url + "?failover_timeout=1")
    await index.open()
    job = next(f"job{i}" for i in range(100)
               if redis_cluster.node_of(f"{{job{i}}}") is not redis_cluster.nodes[-1])
    await index.fence(job)
    await index.begin(job, 1, ["disk"])
    victim = redis_cluster.nodes[-1]
    victim.kill()
    try:
        redis_cluster.wait_state("fail", timeout=20)
        with pytest.raises(IndexUnavailable) as err:
            await index.begin(job, 2, ["disk"])
        message = str(err.value)
        assert "CLUSTERDOWN" in message and "cluster is down" in message and "retried for 1s" in message
        assert cluster_url.split("?")[0].split("//")[1].split(",")[0] in index.identity
        tier = RedisPeerTier("peer", RedisOptions(urls=(cluster_url,)))  # the peer tier names it too, retryable
        await tier.open()
        with pytest.raises(TierUnavailable, match="CLUSTERDOWN"):
            await tier.write(f"{{{job}}}/x", memoryview(b"1"))
        await tier.close()
    finally:
        victim.start()
        redis_cluster.wait_state("ok", timeout=30)
    await index.begin(job, 3, ["disk"])  # the node came back empty; this job's slot was elsewhere
    assert [s.step for s in await index.list(job)] == [1, 3]
    await index.close()


async def test_wait_for_replicas_a_cluster_without_replicas_cannot_give(cluster_url):  # noqa: F811
    index = RedisIndex(cluster_url + "?wait=1&wait_timeout=0.2&failover_timeout=0.5")
    await index.open()
    with pytest.raises(IndexUnavailable, match="acknowledged by 0 of the 1 replica"):
        await index.fence("job")
    await index.close()


async def test_cluster_credentials_work_and_a_wrong_password_is_never_shown(tmp_path):
    from tiered_ckpt.testing.redis_local import LocalCluster

    with LocalCluster(3, base=tmp_path, password="right-pw") as cluster:
        good = RedisIndex(cluster.url.replace("redis+cluster://", "redis+cluster://:right-pw@"))
        await good.open()
        await good.fence("job")
        await good.begin("job", 1, ["disk"])
        assert [s.step for s in await good.list("job")] == [1]
        await good.close()
        wrong = cluster.url.replace("redis+cluster://", "redis+cluster://:wrong-pw@")
        with pytest.raises(tc.TieredCkptError) as err:
            index = RedisIndex(wrong)
            await index.open()
            await index.fence("job")
        assert "refused the credentials" in str(err.value) and "wrong-pw" not in str(err.value)
        tier = RedisPeerTier("peer", RedisOptions(urls=(wrong,)))
        await tier.open()
        with pytest.raises(tc.TieredCkptError) as err:
            await tier.write("job/x", memoryview(b"1"))
        assert "credentials" in str(err.value) and "wrong-pw" not in str(err.value) and "***" in str(err.value)
        await tier.close()


async def test_the_writer_lease_on_a_cluster_refuses_a_second_writer_until_released(cluster_url):  # noqa: F811
    """The lease and the epoch share the job's slot, so taking the lease and fencing stay one script."""
    first, second = RedisIndex(cluster_url, lease_seconds=1.5), RedisIndex(cluster_url)
    await first.open()
    await second.open()
    try:
        epoch = await first.fence("leased", lease=True)
        with pytest.raises(tc.WriterConflict, match="already has a writer"):
            await second.fence("leased", lease=True)
        await first.close()  # releases it
        assert await second.fence("leased", lease=True) > epoch
    finally:
        await first.close()
        await second.close()
