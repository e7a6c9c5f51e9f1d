"""The Redis index at scale, on a real redis-server: a tier's markers are one bitmap per session (tier_state
reads three fields whatever the number of ranks), list() reads the job's summaries (two keys, whatever the
number of checkpoints and ranks), steps written by an earlier release (one marker field per rank, no
summary) still list, unmark and delete, and the commit-storm benchmark leaves nothing behind."""
import asyncio

import pytest
import redis.asyncio as aioredis

from tiered_ckpt.bench.index_storm import list_many, storm
from tiered_ckpt.storage.index.redis import RedisIndex


@pytest.fixture
def server(redis_server):
    return redis_server()


@pytest.fixture
async def index(server):
    index = RedisIndex(server.url)
    await index.open()
    await index.fence("job")
    yield index
    await index.close()


@pytest.fixture
async def raw(server):
    """A plain client on the index's server, to read and write its keys as the stored layout names them
    (`tiered_ckpt:idx:<job>:...`), as an earlier release or an operator would."""
    client = aioredis.Redis.from_url(server.url)
    yield client
    await client.aclose()


async def test_thousands_of_ranks_commit_once_and_tier_state_names_the_missing_ones(index, raw):
    world = 2000
    await index.begin("job", 1, ["disk"])
    late = {7, 1024, 1999}
    results = await asyncio.gather(*(index.mark_durable("job", 1, "disk", r, world, "s")
                                     for r in range(world) if r not in late))
    assert not any(results)
    assert not await index.mark_durable("job", 1, "disk", 5, world, "s")  # a repeat counts once
    state = await index.tier_state("job", 1, "disk", "s")
    assert state.state == "pending" and set(range(world)) - state.ranks_done == late
    bitmap = await raw.hget("tiered_ckpt:idx:job:step:1", "done:disk:s")
    assert len(bitmap) == world // 8  # one bit per rank, whatever the world size
    assert (await index.tier_state("job", 1, "disk", "other-session")).ranks_done == frozenset()
    results = await asyncio.gather(*(index.mark_durable("job", 1, "disk", r, world, "s") for r in sorted(late)))
    assert sorted(results) == [False, False, True]
    assert (await index.tier_state("job", 1, "disk", "s")).state == "complete"


async def test_list_reads_the_summaries_not_the_step_hashes(index, monkeypatch):
    for step in (1, 2):
        await index.begin("job", step, ["host", "disk"], {"nbytes": 10 * step, "metadata": {"s": step}})
        await asyncio.gather(*(index.put_rank_meta("job", step, r, b"x" * 100) for r in range(500)))
        await asyncio.gather(*(index.mark_durable("job", step, "disk", r, 500, "s") for r in range(500)))
    await index.mark_failed("job", 2, "host", 3, "s", "TierFull: no space")

    async def never(*_):
        raise AssertionError("list() read the step hashes")

    monkeypatch.setattr(index, "_small_fields", never)
    one, two = await index.list("job")
    assert (one.step, one.tiers, one.complete, one.failed, one.nbytes, one.metadata) == (
        1, ("host", "disk"), frozenset({"disk"}), {}, 10, {"s": 1})
    assert two.failed == {"host": "rank 3: TierFull: no space"} and two.created > 0
    assert (await index.tier_state("job", 2, "host", "s")).reason == "rank 3: TierFull: no space"
    await index.unmark("job", 2, "disk")
    assert [(s.step, s.tiers, s.complete) for s in await index.list("job")] == [
        (1, ("host", "disk"), frozenset({"disk"})), (2, ("host",), frozenset())]


async def test_steps_an_earlier_release_wrote_are_still_listed_unmarked_and_deleted(index, raw):
    """Release 0.1's layout: one durable marker field per rank, no summary. Written here by hand."""
    client, old = raw, "tiered_ckpt:idx:job:step:3"
    await client.hset(old, mapping={"created": "1700000000.5", "target:host": "0", "target:disk": "1",
                                    "manifest": b"m", "rank:0": b"r0", "durable:disk:old:0": "1",
                                    "count:disk:old": "1", "complete:disk": "1", "failed:host:0:old": "TierFull: x"})
    await client.zadd("tiered_ckpt:idx:job:steps", {"3": 3})
    await index.begin("job", 4, ["disk"])  # a new step beside it
    three, four = await index.list("job")
    assert (three.step, three.tiers, three.complete, three.failed, three.created) == (
        3, ("host", "disk"), frozenset({"disk"}), {"host": "rank 0: TierFull: x"}, 1700000000.5)
    assert four.step == 4 and not four.complete
    assert await index.get_manifest("job", 3) == b"m"
    await index.unmark("job", 3, "disk")
    assert (await index.list("job"))[0].complete == frozenset()
    assert not await client.hexists(old, "durable:disk:old:0")
    for step in (3, 4):
        await index.delete("job", step)
    assert sorted([k.decode() async for k in client.scan_iter(match="tiered_ckpt:idx:job:*")]) == [
        "tiered_ckpt:idx:job:epoch"]


async def test_the_commit_storm_benchmark_runs_and_leaves_nothing_behind(redis_server):
    url = redis_server().url
    result = await storm(url, 64, connections=8)
    assert result["commit_s"] > 0 and result["mark_p99_ms"] >= result["mark_p50_ms"] > 0
    assert result["keys_left_after_delete"] == 0 and result["memory_usage_left_after_delete"] == 0
    assert result["memory_usage_per_checkpoint"] > 64 * 1024  # at least the rank records
    listing = await list_many(url, 30, world=4, repeats=1)
    assert listing["checkpoints"] == 30 and listing["list_s"] > 0
    client = aioredis.Redis.from_url(url)
    assert [k async for k in client.scan_iter(match="tiered_ckpt:idx:storm:*")] == [b"tiered_ckpt:idx:storm:epoch"]
    assert await client.dbsize() == 1 + 3 + 30  # storm's epoch; many's epoch, steps, summaries and 30 steps
    await client.aclose()
