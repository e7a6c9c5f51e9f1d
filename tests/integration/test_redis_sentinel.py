"""The Redis index behind Sentinel, with real processes: a master, one replica and one sentinel (quorum 1).
Conformance, WAIT for the replica (a clear error when it cannot answer), and the promise that matters: kill
the master (SIGKILL) in the middle of a run of saves, and every save that reported success is still complete
after the failover and loads bit-exact, while saves go on through the new master."""
import asyncio
import subprocess
import time

import pytest
import redis.asyncio as aioredis
import torch

import tiered_ckpt as tc
from tiered_ckpt.testing import configs
from tiered_ckpt.errors import IndexUnavailable
from tiered_ckpt.storage.index.redis import RedisIndex
from tiered_ckpt.testing import IndexConformance, TierConformance
from tiered_ckpt.storage.tiers.redis_peer import RedisOptions, RedisPeerTier

from .redis_deploy import sentinel_deployment  # noqa: F401  (fixture)


class TestSentinelIndex(IndexConformance):
    @pytest.fixture
    def make_index(self, sentinel_deployment):  # noqa: F811
        url = sentinel_deployment.url  # wait=1 by default: every write is acknowledged by the replica
        return lambda: RedisIndex(url)


class TestSentinelPeerTier(TierConformance):  # the peer tier reaches its master through the sentinel too
    @pytest.fixture
    def make_tier(self, sentinel_deployment):  # noqa: F811
        url = sentinel_deployment.url
        return lambda: RedisPeerTier("peer", RedisOptions(urls=(url,), chunk_size=100_000))


def stack(tmp_path, shm_dir, index_url, job="gpt", disk="local"):
    return configs.stack(tmp_path, {"kind": "memory", "keep_last": 3}, {"kind": disk, "keep_last": 1000},
                         shm=shm_dir, job=job, index=index_url)


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(40_000, generator=g), "meta": {"step": step}}


async def test_writes_wait_for_the_replica_and_say_so_when_it_cannot_answer(sentinel_deployment):  # noqa: F811
    index = RedisIndex(sentinel_deployment.url + "?wait_timeout=0.3&failover_timeout=1")
    await index.open()
    await index.fence("job")
    await index.begin("job", 1, ["disk"])
    replica = next(s for s in sentinel_deployment.servers if s.port != sentinel_deployment.master_port())
    replica.kill()
    started = time.monotonic()
    with pytest.raises(IndexUnavailable) as err:
        await index.mark_durable("job", 1, "disk", 0, 1, "s")
    message = str(err.value)
    assert "acknowledged by 0 of the 1 replica(s)" in message and "commit of step 1 on disk" in message
    assert index.identity in message and "retried for 1s" in message
    assert time.monotonic() - started < 10
    await index.close()
    relaxed = RedisIndex(sentinel_deployment.url + "?wait=0")  # wait=0: the master's word is enough
    await relaxed.open()
    relaxed.epoch = index.epoch
    assert await relaxed.mark_durable("job", 1, "disk", 0, 1, "s")  # the marker was there: idempotent
    await relaxed.close()


async def test_a_failover_in_the_middle_of_saves_loses_no_acknowledged_save(tmp_path, shm_dir,
                                                                          sentinel_deployment):  # noqa: F811
    """Saves run back to back while the replica falls behind and the master is then SIGKILLed: what only the
    master had is lost with it. The sentinel promotes the replica, and the killed server comes back
    empty (no persistence), which the sentinel turns into the new master's replica. Each
    save either reports success, and then is listed complete and loads bit-exact after the failover, or fails
    with a clear error; saves after the failover succeed through the new master. With the default wait=1 the
    saves in flight wait (failover_timeout, 30 s) until the new master has a replica to acknowledge them."""
    d = sentinel_deployment
    loop = asyncio.get_running_loop()
    old_master = d.master_port()
    ok: list[int] = []
    failed: dict[int, str] = {}
    spans: dict[int, tuple[float, float]] = {}

    async def fail_over() -> tuple[float, int]:
        replica = next(p for p in d.servers if p.port != old_master)
        # the replica falls behind: frozen (DEBUG SLEEP) while the master drops its link, so the writes of the
        # next second reach the master alone; then the master dies (SIGKILL) and those writes with it
        frozen = subprocess.Popen(["redis-cli", "-p", str(replica.port), "debug", "sleep", "2.5"],
                                  stdout=subprocess.DEVNULL)
        await asyncio.sleep(0.2)
        subprocess.run(["redis-cli", "-p", str(old_master), "client", "kill", "type", "replica"], check=True,
                       capture_output=True)
        await asyncio.sleep(1.0)
        disk.inject("stall")  # the next save's disk write waits for the kill: a save is in flight when it comes
        deadline = time.monotonic() + 30
        while disk.stalled() == 0:
            assert time.monotonic() < deadline, "no disk write was held"
            await asyncio.sleep(0.005)
        await loop.run_in_executor(None, d.server_on(old_master).kill)
        killed = time.monotonic()
        disk.clear()
        await loop.run_in_executor(None, frozen.wait)
        new_master = await loop.run_in_executor(None, d.wait_for_failover, old_master)
        await loop.run_in_executor(None, d.rejoin, old_master)  # back, empty, as the new master's replica
        return killed, new_master

    async with tc.Engine(stack(tmp_path, shm_dir, d.url, disk="faulty")) as engine:
        disk = configs.faults(engine.config)

        async def save(step: int) -> None:
            started = time.monotonic()
            try:
                await (await engine.save(step, state(step))).wait()
                ok.append(step)
            except tc.TieredCkptError as e:
                failed[step] = f"{type(e).__name__}: {e}"
            spans[step] = (started, time.monotonic())

        for step in range(1, 4):  # before: every save acknowledged
            await save(step)
        assert ok == [1, 2, 3], failed
        failure = asyncio.create_task(fail_over())
        step, after, deadline = 3, 0, time.monotonic() + 45
        while after < 3:  # saves go on through the failover, and three more after it
            step += 1
            await save(step)
            after += failure.done()
            assert time.monotonic() < deadline, f"saves never got through after the failover: {failed}"
            await asyncio.sleep(0.1)
        killed, new_master = await failure
    async with tc.Engine(stack(tmp_path, shm_dir, d.url)) as engine:  # a new process, through the sentinel
        listing = {c.step: c async for c in engine.list()}
        for saved in ok:  # nothing that reported success vanished
            assert saved in listing and "disk" in listing[saved].complete, (saved, listing.get(saved), failed)
            out = {"w": torch.zeros(40_000), "meta": {}}
            info = await engine.load(out, step=saved, tiers=["disk"])
            assert info.step == saved and not info.fallbacks
            assert torch.equal(out["w"], state(saved)["w"]) and out["meta"] == {"step": saved}
    assert new_master != old_master
    assert any(a < killed < b for a, b in spans.values()), "no save was in flight when the master died"
    assert ok[-3:] == [step - 2, step - 1, step], failed  # saves continue after the failover
    for reason in failed.values():  # a save in flight during the failover may fail, naming why
        assert "index redis+sentinel://" in reason and ("unreachable" in reason or "replica" in reason), reason


async def test_a_plain_url_retries_through_a_failover_of_its_endpoint(redis_server):
    """A managed service's endpoint (one redis:// URL) moves to the promoted replica; until it does, the old
    primary answers READONLY. With failover_timeout the index retries (on new connections) until writes go
    through; without it the error names READONLY at once."""
    primary = redis_server()
    replica = redis_server("--replicaof", "127.0.0.1", str(primary.port))
    impatient = RedisIndex(replica.url)
    await impatient.open()
    with pytest.raises(IndexUnavailable, match="READONLY"):
        await impatient.fence("job")
    await impatient.close()
    index = RedisIndex(replica.url + "?failover_timeout=10")
    await index.open()

    async def promote() -> None:
        await asyncio.sleep(0.5)
        client = aioredis.Redis(port=replica.port)
        await client.execute_command("REPLICAOF", "NO", "ONE")
        await client.aclose()

    promoting = asyncio.create_task(promote())
    started = time.monotonic()
    assert await index.fence("job") > 0  # an epoch (above the server clock in ms), once the replica is promoted
    assert time.monotonic() - started >= 0.4
    await promoting
    await index.close()


async def test_no_sentinel_answering_is_one_short_line_within_failover_timeout():
    # no process listens on a port just freed: every sentinel connection is refused at once
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    index = RedisIndex(f"redis+sentinel://127.0.0.1:{port}/mymaster?failover_timeout=1")
    await index.open()
    try:
        started = time.monotonic()
        with pytest.raises(IndexUnavailable) as caught:
            await index.jobs()
        elapsed = time.monotonic() - started
    finally:
        await index.close()
    message = str(caught.value)
    # redis-py's own retries backed off for seconds per lookup (4.4 s each, 12.4 s for one `ls`), and its
    # error carried the client's 1,300-character repr
    assert elapsed < 3.5, elapsed
    assert "<redis." not in message and len(message) < 400, message
    assert "No master found for 'mymaster'" in message and f"127.0.0.1:{port}" in message
