"""The Redis index against real redis-server processes: commit, listing, retention, fencing of zombie
writers, and loading from the tiers' manifests while the index is down."""
import asyncio
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import tiered_ckpt as tc
from tiered_ckpt.testing import configs


def stack(tmp_path, shm_dir, index_url, job="gpt", disk="local", **engine):
    return configs.stack(tmp_path, {"kind": "memory", "keep_last": 2}, disk, shm=shm_dir, job=job, index=index_url,
                         **engine)


def state(value: float) -> dict:
    return {"w": torch.full((50_000,), value), "meta": {"step": int(value)}}


async def test_save_list_load_delete_and_retention(tmp_path, shm_dir, redis_server):
    url = redis_server().url
    async with tc.Engine(stack(tmp_path, shm_dir, url)) as engine:
        for step in (1, 2, 3):
            await (await engine.save(step, state(float(step)))).wait()
        listing = {c.step: c.complete async for c in engine.list()}
        assert listing == {1: {"disk"}, 2: {"host", "disk"}, 3: {"host", "disk"}}  # keep_last=2 on host
        out = state(0.0)
        info = await engine.load(out)
        assert info.step == 3 and torch.all(out["w"] == 3.0) and out["meta"] == {"step": 3}
        await engine.delete(3)
        assert [c.step async for c in engine.list()] == [1, 2]
    async with tc.Engine(stack(tmp_path, shm_dir, url)) as engine:  # a new process finds them in Redis
        out = state(0.0)
        assert (await engine.load(out)).step == 2 and torch.all(out["w"] == 2.0)


async def test_a_zombie_from_an_earlier_incarnation_cannot_commit_or_delete(tmp_path, shm_dir, redis_server):
    url = redis_server().url
    zombie = await tc.Engine(stack(tmp_path, shm_dir, url)).open()
    await (await zombie.save(1, state(1.0))).wait()
    async with tc.Engine(stack(tmp_path, shm_dir, url)) as restarted:  # the job restarts
        out = state(0.0)
        assert (await restarted.load(out)).step == 1  # resuming reads: it fences no one yet
        await (await restarted.save(2, state(2.0))).wait()  # the first save starts a new epoch
        assert restarted.store.index.epoch > zombie.store.index.epoch
        handle = await zombie.save(3, state(3.0))
        with pytest.raises(tc.SaveError, match="earlier incarnation"):
            await handle.wait()
        with pytest.raises(tc.TieredCkptError, match="earlier incarnation"):
            await zombie.delete(1)
        assert [(c.step, c.is_complete) async for c in restarted.list()] == [(1, True), (2, True)]  # 3 never began
        assert (await restarted.load(out)).step == 2
    await zombie.close(raise_errors=False)


async def test_index_down_loads_the_newest_complete_checkpoint_from_the_tiers(tmp_path, shm_dir, redis_server,
                                                                             caplog):
    server = redis_server()
    async with tc.Engine(stack(tmp_path, shm_dir, server.url)) as engine:
        for step in (1, 2):
            await (await engine.save(step, state(float(step)))).wait()
    server.stop()
    caplog.set_level(logging.WARNING)
    async with tc.Engine(stack(tmp_path, shm_dir, server.url)) as engine:
        out = state(0.0)
        info = await engine.load(out)
        assert info.step == 2 and torch.all(out["w"] == 2.0) and out["meta"] == {"step": 2}
        assert [(c.step, sorted(c.complete)) async for c in engine.list()] == [(1, ["disk", "host"]), (2, ["disk", "host"])]
        handle = await engine.save(3, state(3.0))
        with pytest.raises(tc.SaveError, match="unreachable"):
            await handle.wait()
    assert any(server.url in r.getMessage() and "manifests on the tiers" in r.getMessage() for r in caplog.records)


async def test_cli_reads_the_redis_index(tmp_path, shm_dir, redis_server):
    import subprocess
    import sys

    url = redis_server().url
    async with tc.Engine(stack(tmp_path, shm_dir, url)) as engine:
        await (await engine.save(7, state(7.0))).wait()
    config = tmp_path / "redis.toml"
    config.write_text(f'''[engine]
job = "gpt"
index = "{url}"
part_size = "64KiB"

[[tiers]]
name = "host"
kind = "memory"
path = "{shm_dir / 'host'}"

[[tiers]]
name = "disk"
kind = "local"
path = "{tmp_path / 'disk'}"
''')
    ls = subprocess.run([sys.executable, "-m", "tiered_ckpt.cli", "ls", "-c", str(config)], capture_output=True,
                        text=True, timeout=60)
    assert ls.returncode == 0 and "complete    host* disk*" in ls.stdout, ls.stderr
    assert [line.split()[0] for line in ls.stdout.splitlines() if line.split() and line.split()[0].isdigit()] == ["7"]


async def test_readers_beside_a_trainer_fence_nothing_and_delete_nothing(tmp_path, shm_dir, redis_server):
    """An evaluator (an engine that only lists and loads) and the CLI open the index while the trainer runs:
    the trainer's later commits still succeed, and a save the trainer has in flight is not removed."""
    import subprocess
    import sys

    url = redis_server().url
    async with tc.Engine(stack(tmp_path, shm_dir, url, disk="faulty")) as trainer:
        await (await trainer.save(1, state(1.0))).wait()
        disk = configs.faults(trainer.config)
        disk.inject("stall", keys="step-000000000002")  # until cleared
        in_flight = await trainer.save(2, state(2.0))  # complete on host soon; disk held
        await in_flight.wait("host")
        async with tc.Engine(stack(tmp_path, shm_dir, url)) as evaluator:
            out = state(0.0)
            assert (await evaluator.load(out)).step == 2 and torch.all(out["w"] == 2.0)  # host is complete
            assert [c.step async for c in evaluator.list()] == [1, 2]
        raw = configs.stack_dict(tmp_path, shm=shm_dir, job="gpt", index=url, part_size=None)
        config = configs.write_toml(tmp_path / "cli.toml", raw)
        ls = subprocess.run([sys.executable, "-m", "tiered_ckpt.cli", "ls", "-c", str(config)], capture_output=True,
                            text=True, timeout=60)
        assert ls.returncode == 0, ls.stderr
        disk.clear()
        await in_flight.wait()  # the trainer commits step 2 on disk: nobody fenced it
        await (await trainer.save(3, state(3.0))).wait()
        assert [(c.step, sorted(c.complete)) async for c in trainer.list()][-2:] == [
            (2, ["disk", "host"]), (3, ["disk", "host"])]


async def test_an_index_on_a_redis_that_may_evict_it_is_refused_at_open(tmp_path, shm_dir, redis_server):
    url = redis_server("--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru").url
    with pytest.raises(tc.ConfigError, match="allkeys-lru.*noeviction"):
        async with tc.Engine(stack(tmp_path, shm_dir, url)):
            pass
    volatile = redis_server("--maxmemory", "64mb", "--maxmemory-policy", "volatile-lru").url
    async with tc.Engine(stack(tmp_path, shm_dir, volatile)) as engine:  # evicts only keys with a TTL: fine
        await (await engine.save(1, state(1.0))).wait()


async def test_a_wrong_password_is_a_clear_error_without_the_password(tmp_path, shm_dir, redis_server):
    server = redis_server("--requirepass", "right-one")
    url = server.url.replace("redis://", "redis://:wrong-one@")
    with pytest.raises(tc.TieredCkptError) as err:  # at open, at once: not retried as "unreachable"
        async with tc.Engine(stack(tmp_path, shm_dir, url)):
            pass
    assert "refused the credentials" in str(err.value) and "wrong-one" not in str(err.value)


async def test_a_server_that_is_not_redis_at_the_index_url_is_a_clear_error(tmp_path, shm_dir):
    async def not_redis(reader, writer):
        await reader.read(100)
        writer.write(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(not_redis, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(tc.TieredCkptError, match=rf"index redis://127.0.0.1:{port}/0.*is this a Redis server"):
            async with tc.Engine(stack(tmp_path, shm_dir, f"redis://127.0.0.1:{port}/0")):
                pass
    finally:
        server.close()
        await server.wait_closed()


async def test_a_zombie_writer_never_overwrites_what_the_new_incarnation_committed(tmp_path, shm_dir, redis_server,
                                                                                   monkeypatch):
    """An old incarnation's save of step 1 is stalled in its part writes while a new incarnation fences it and
    commits its own step 1. When the zombie's writes go through, they land in its own folder: the committed
    step 1 still loads exactly, and the zombie's commit is refused."""
    url = redis_server().url
    async with tc.Engine(stack(tmp_path, shm_dir, url, role="writer")) as zombie:  # its probe writes done at open
        release = asyncio.Event()
        for tier in map(zombie.store.io.driver, zombie.store.io.names):
            async def held(key, data, real_write=tier.write):
                await release.wait()
                return await real_write(key, data)

            monkeypatch.setattr(tier, "write", held)
        stalled = await zombie.save(1, state(1.0))
        async with tc.Engine(stack(tmp_path, shm_dir, url)) as successor:
            await (await successor.save(1, state(2.0))).wait()
            release.set()
            with pytest.raises(tc.SaveError, match="FENCED|earlier incarnation"):
                await stalled.wait()
            assert zombie.incarnation != successor.incarnation
            for tier in ("host", "disk"):
                out = state(0.0)
                info = await successor.load(out, tiers=[tier])
                assert info.step == 1 and torch.all(out["w"] == 2.0) and not info.fallbacks, tier


async def test_a_second_trainer_with_role_writer_fails_at_open_naming_the_live_one(tmp_path, shm_dir, redis_server):
    """role = "writer" on the Redis index holds a writer lease it renews: a second trainer's open() fails with
    WriterConflict naming the first (pid, host), which trains on unfenced (before: the second took over, and
    the first went on training with every save failing). Once the first closes, its lease is free at once."""
    url = redis_server().url
    first = tc.Engine(stack(tmp_path, shm_dir, url, role="writer"))
    first.store.index.lease_seconds = 1.5  # renewed every 0.5 s
    await first.open()
    try:
        await (await first.save(1, state(1.0))).wait()
        started = time.monotonic()
        with pytest.raises(tc.WriterConflict, match=f"already has a writer .*pid {os.getpid()} on "
                                                    f"{socket.gethostname()}"):
            await tc.Engine(stack(tmp_path, shm_dir, url, role="writer")).open()
        assert time.monotonic() - started < 5  # it saw a renewal: no wait for a lease that will not lapse
        await (await first.save(2, state(2.0))).wait()  # not fenced
    finally:
        await first.close()
    started = time.monotonic()
    async with tc.Engine(stack(tmp_path, shm_dir, url, role="writer")) as third:  # released at close
        assert time.monotonic() - started < 1.0
        await (await third.save(3, state(3.0))).wait()
        assert [c.step async for c in third.list()] == [1, 2, 3]


async def test_a_writer_killed_with_sigkill_does_not_block_its_restart(tmp_path, shm_dir, redis_server):
    """A trainer killed with -9 renews its lease no more: the restart (role = "writer") takes it once it lapses,
    within the lease's TTL, and fences the dead incarnation."""
    url = redis_server().url
    config = tmp_path / "c.toml"
    config.write_text(f'[engine]\njob = "gpt"\nindex = "{url}"\npart_size = "64KiB"\n'
                      f'[[tiers]]\nname = "host"\nkind = "memory"\npath = "{shm_dir}/host"\nkeep_last = 2\n'
                      f'[[tiers]]\nname = "disk"\nkind = "local"\npath = "{tmp_path}/disk"\n')
    helper = Path(__file__).with_name("lease_holder.py")
    proc = subprocess.Popen([sys.executable, str(helper), str(config), "2"], stdout=subprocess.PIPE, text=True)
    try:
        ready, epoch = proc.stdout.readline().split()
        assert ready == "ready"
    finally:
        proc.kill()
        proc.wait()
    started = time.monotonic()
    async with tc.Engine.from_toml(config, role="writer") as restarted:
        assert time.monotonic() - started < 2 + 3  # the dead lease's TTL at most, with room for a slow machine
        assert restarted.store.index.epoch > int(epoch)  # a new incarnation
        out = {"w": torch.zeros(50_000)}
        assert (await restarted.load(out)).step == 1 and torch.all(out["w"] == 1.0)
        await (await restarted.save(2, state(2.0))).wait()
