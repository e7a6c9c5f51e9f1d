"""What operations do to a Redis index, on real redis-server processes: restarted empty, FLUSHDB, restored
from an older snapshot, a flipped byte. The live trainer goes on committing, no load hands back a step whose
data is gone, and the tiers converge to keep_last whatever the index forgot."""
import logging
from pathlib import Path

import pytest
import redis
import torch

import tiered_ckpt as tc
from tiered_ckpt.config import parse_config
from tiered_ckpt.layout import step_dir


def stack(tmp_path, shm_dir, url, keep_last=2):
    return parse_config({
        "engine": {"job": "gpt", "index": url, "part_size": "64KiB"},
        "tiers": [{"name": "host", "kind": "memory", "path": str(shm_dir / "host"), "keep_last": keep_last},
                  {"name": "disk", "kind": "local", "path": str(tmp_path / "disk"), "keep_last": keep_last}]})


def state(value: float) -> dict:
    return {"w": torch.full((50_000,), value)}


def held(tmp_path, shm_dir) -> dict[str, list[int]]:
    out = {}
    for name, root in (("host", shm_dir / "host"), ("disk", tmp_path / "disk")):
        folder = Path(root) / "gpt"
        out[name] = sorted(int(p.name[5:]) for p in folder.iterdir() if p.name.startswith("step-")) \
            if folder.exists() else []
    return out


async def loaded_step(engine) -> tuple[int, float]:
    out = state(0.0)
    info = await engine.load(out)
    return info.step, float(out["w"][0])


async def test_an_index_restored_from_an_older_snapshot_loses_no_checkpoint(tmp_path, shm_dir, redis_server):
    """The index is restored from a snapshot taken after step 4 while steps 5-7 were saved since: it lists
    steps retention removed (3 and 4) and not the newer ones, whole on both tiers. The live trainer and a
    restarted process load step 7; later saves retire 6 and 7 from the tiers though the index never heard of
    them, and the old entries whose data is gone."""
    server = redis_server()
    client = redis.Redis(port=server.port)
    async with tc.Engine(stack(tmp_path, shm_dir, server.url)) as trainer:
        for step in range(1, 5):
            await (await trainer.save(step, state(float(step)))).wait()
        snapshot = {key: client.dump(key) for key in client.keys("tiered_ckpt:*")}
        for step in range(5, 8):
            await (await trainer.save(step, state(float(step)))).wait()
        client.flushdb()
        for key, value in snapshot.items():
            client.restore(key, 0, value)
        assert [c.step for c in await trainer.statuses() if c.is_complete] == [3, 4]
        assert held(tmp_path, shm_dir) == {"host": [6, 7], "disk": [6, 7]}
        assert await loaded_step(trainer) == (7, 7.0)
        async with tc.Engine(stack(tmp_path, shm_dir, server.url)) as restarted:
            assert await loaded_step(restarted) == (7, 7.0)
        for step in (8, 9):
            await (await trainer.save(step, state(float(step)))).wait()
        assert held(tmp_path, shm_dir) == {"host": [8, 9], "disk": [8, 9]}
        assert await loaded_step(trainer) == (9, 9.0)


async def test_a_redis_index_restarted_empty_never_wedges_the_live_trainer(tmp_path, shm_dir, redis_server):
    """The Redis server restarts empty (no persistence) under a live trainer: its next saves commit again (the
    epoch it lost is re-established), the checkpoints the index forgot still count for retention, and a
    real newer writer still fences the old one."""
    server = redis_server()
    trainer = await tc.Engine(stack(tmp_path, shm_dir, server.url)).open()
    try:
        for step in (1, 2, 3):
            await (await trainer.save(step, state(float(step)))).wait()
        server.stop()
        server.start()  # empty, same port
        for step in (4, 5):
            await (await trainer.save(step, state(float(step)))).wait()
        assert [c.step for c in await trainer.statuses() if c.is_complete] == [4, 5]
        assert held(tmp_path, shm_dir) == {"host": [4, 5], "disk": [4, 5]}
        redis.Redis(port=server.port).delete("tiered_ckpt:idx:gpt:epoch")  # only the epoch lost, this time
        await (await trainer.save(6, state(6.0))).wait()
        async with tc.Engine(stack(tmp_path, shm_dir, server.url)) as successor:
            await (await successor.save(7, state(7.0))).wait()  # a new incarnation fences the old one
            with pytest.raises(tc.SaveError, match="earlier incarnation") as err:
                await (await trainer.save(8, state(8.0))).wait()
            assert all(isinstance(e, tc.Fenced) for e in err.value.errors.values())
            assert await loaded_step(successor) == (7, 7.0)
    finally:
        await trainer.close(raise_errors=False)


async def test_flushdb_between_runs_the_next_run_resumes_and_converges(tmp_path, shm_dir, redis_server):
    """FLUSHDB while no trainer runs: the tiers hold steps 2 and 3, the index nothing. The next run resumes
    from step 3, lists 2 and 3 again at its first save, and retention keeps keep_last on every tier."""
    server = redis_server()
    async with tc.Engine(stack(tmp_path, shm_dir, server.url)) as first:
        for step in (1, 2, 3):
            await (await first.save(step, state(float(step)))).wait()
    redis.Redis(port=server.port).flushdb()
    async with tc.Engine(stack(tmp_path, shm_dir, server.url)) as second:
        assert await loaded_step(second) == (3, 3.0)
        await (await second.save(4, state(4.0))).wait()
        assert [c.step for c in await second.statuses() if c.is_complete] == [3, 4]  # 2 listed again, then retired
        await (await second.save(5, state(5.0))).wait()
        assert held(tmp_path, shm_dir) == {"host": [4, 5], "disk": [4, 5]}


async def test_a_flipped_byte_in_the_list_summary_is_caught_and_the_step_listed_from_its_record(
        tmp_path, shm_dir, redis_server, caplog):
    server = redis_server()
    client = redis.Redis(port=server.port)
    async with tc.Engine(stack(tmp_path, shm_dir, server.url)) as engine:
        await (await engine.save(1, state(1.0), metadata={"name": "alpha"})).wait()
        key = "tiered_ckpt:idx:gpt:list"
        raw = client.hget(key, "1")
        at = raw.rindex(b"alpha") + 4
        client.hset(key, "1", raw[:at] + b"b" + raw[at + 1:])  # alpha → alphb, the seal unchanged
        caplog.set_level(logging.WARNING)
        [status] = [c async for c in engine.list()]
        assert status.metadata == {"name": "alpha"} and status.complete == {"host", "disk"}
        assert "summary of step(s) [1]" in caplog.text and "damaged" in caplog.text
        client.hset(key, "1", raw[:44] + b"\xc1" + raw[45:])  # not msgpack at all, and the seal wrong
        [status] = [c async for c in engine.list()]
        assert status.created > 0 and status.metadata == {"name": "alpha"}


async def test_a_frozen_index_holds_a_save_no_longer_than_index_timeout_and_saves_commit_after(
        tmp_path, shm_dir, redis_server):
    """The index's redis-server is SIGSTOPped (port open, no answer) right after a save: the saves meanwhile return
    within index_timeout (the one in flight fails, naming the index and the key; it holds the staging buffer no
    longer), training goes on (one save that committed nowhere is no reason to stop), and once the server runs
    again the next save commits on every tier and loads."""
    import os
    import signal
    import time

    server = redis_server()
    config = stack(tmp_path, shm_dir, server.url).replace_engine(index_timeout=1.0)
    async with tc.Engine(config) as trainer:
        await (await trainer.save(1, state(1.0))).wait()
        handle = await trainer.save(2, state(2.0))
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            await trainer.save(3, state(3.0))  # waits for save 2's buffer: bounded by the index's timeout
            blocked = time.monotonic() - started
            await trainer.wait_all()
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert blocked < 8.0  # index_timeout is 1 s; the index's default socket timeout (30 s) would be far over
        assert handle.errors and not handle.committed_on
        assert all("index_timeout = 1s" in str(e) and server.url in str(e) for e in handle.errors.values())
        await (await trainer.save(4, state(4.0))).wait()  # no raise: 2 saves in a row failed, the limit is 3
        assert (await trainer.status(4)).complete == {"host", "disk"}
        assert await loaded_step(trainer) == (4, 4.0)
