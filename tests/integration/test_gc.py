"""`tiered-ckpt gc` and `delete` on what real crashes leave, and beside a running trainer on the Redis index.

A saving process is SIGKILLed inside a save (tests/integration/crash_saver.py, as test_crash.py does); gc
then removes exactly what that save left. With the Redis index gc cannot know whether a trainer runs, so it
keeps a save in flight and removes only saves that began more than the grace period ago, and it never
fences: the trainer's commits go on succeeding."""
import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tiered_ckpt as tc
from tiered_ckpt import cli
from tiered_ckpt.layout import PartKey, incarnation_dir, new_session, step_dir
from tiered_ckpt.testing.configs import faults, stack_dict, write_toml

HERE = Path(__file__).parent
pytestmark = pytest.mark.timeout(300)


def tree(*roots: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for root in roots:
        for dirpath, dirs, files in os.walk(root):
            for name in dirs + files:
                st = os.lstat(os.path.join(dirpath, name))
                out[os.path.join(dirpath, name)] = (st.st_size if name in files else 0, st.st_mtime_ns)
    return out


def toml(path: Path, tmp_path: Path, *tiers: object, **engine: object) -> Path:
    """What crash_saver.py expects: job crash, parts of 1 MiB."""
    return write_toml(path, stack_dict(tmp_path, *tiers, job="crash", part_size="1MiB", **engine))


def host_and_disk(shm_dir: Path) -> tuple[dict, dict]:
    return {"kind": "memory", "path": str(shm_dir / "host")}, {"kind": "local", "workers": 2}


# phase of the killed save of step 2 → what gc must remove: the whole checkpoint, or its unfinished disk tier
PHASES = {"parts-partly-on-host": "checkpoint", "host-committed": "disk"}


@pytest.mark.parametrize("phase", PHASES)
def test_gc_removes_what_a_killed_save_left_and_keeps_what_completed(tmp_path, shm_dir, phase, capsys):
    config = toml(tmp_path / "crash.toml", tmp_path, *host_and_disk(shm_dir))
    proc = subprocess.Popen([sys.executable, str(HERE / "crash_saver.py"), str(config), phase],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "committed 1"
        assert proc.stdout.readline().strip() == f"phase {phase}"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    roots = (shm_dir / "host", tmp_path / "disk", tmp_path / "index")
    step2 = [p for root in roots[:2] for p in root.rglob("*") if step_dir(2) in str(p) and p.is_file()]
    assert step2  # the killed save left parts behind

    before = tree(*roots)
    assert cli.main(["-c", str(config), "gc", "--dry-run"]) == 0
    dry = capsys.readouterr().out
    assert tree(*roots) == before and "dry run: nothing changed" in dry and "would remove" in dry
    assert cli.main(["-c", str(config), "gc"]) == 0
    out = capsys.readouterr().out
    assert out.replace("would remove", "removed").split("\n")[1:] == dry.replace("would remove", "removed").split(
        "\n")[1:]  # the dry run printed what the real one did
    assert "no writer can be running" in out

    async def check():
        async with tc.Engine.from_toml(config) as engine:
            listing = {c.step: c for c in [c async for c in engine.list()]}
            assert listing[1].complete == {"host", "disk"}
            if PHASES[phase] == "checkpoint":
                assert 2 not in listing
                assert "index: removed 1 checkpoint(s): 2" in out
            else:  # complete on host: kept there; the disk tier it never completed on is dropped
                assert listing[2].complete == {"host"} and listing[2].tiers == ("host",)
                out2 = {"w": torch.zeros(6 * 2**20), "v": torch.zeros(1000, dtype=torch.float64)}
                info = await engine.load(out2, step=2)
                assert info.fallbacks == [] and torch.all(out2["w"] == 2.0)
            out1 = {"w": torch.zeros(6 * 2**20), "v": torch.zeros(1000, dtype=torch.float64)}
            assert (await engine.load(out1, step=1, tiers=["disk"])).fallbacks == [] and torch.all(out1["w"] == 1.0)
            assert (await engine.gc()).removed == []

    asyncio.run(check())
    left = [p for p in (tmp_path / "disk").rglob("*") if step_dir(2) in str(p)]
    assert left == []  # nothing of step 2 stays on disk: parts, folders (temp files of the cut write are debris
    # only once older than the grace period, and a killed pwrite leaves none on disk: it never got a part there)
    host_left = [p for p in (shm_dir / "host").rglob("*") if step_dir(2) in str(p) and p.is_file()]
    assert bool(host_left) == (PHASES[phase] == "disk")


def redis_dump(url: str) -> dict[bytes, object]:
    import redis

    client = redis.Redis.from_url(url)
    out: dict[bytes, object] = {}
    for key in client.scan_iter("*"):
        kind = client.type(key)
        out[key] = {b"hash": client.hgetall, b"string": client.get, b"zset": lambda k: client.zrange(k, 0, -1),
                    b"set": client.smembers}[kind](key)
    client.close()
    return out


async def test_gc_and_delete_beside_a_running_trainer_on_the_redis_index(tmp_path, shm_dir, redis_server, capsys):
    """The trainer saves step 2 (held on disk, so incomplete) while `tiered-ckpt gc` runs: gc keeps it and
    removes step 5, which an earlier run began two hours ago; a dry run changes nothing in Redis or on the
    tiers; `tiered-ckpt delete` refuses the step in flight and deletes a complete one; the trainer is never
    fenced: its save completes and its next save commits."""
    server = redis_server()
    config = toml(tmp_path / "redis.toml", tmp_path, "faulty", index=server.url)
    state = lambda v: {"w": torch.full((300_000,), float(v))}  # noqa: E731
    async with tc.Engine.from_toml(config) as trainer:
        for step in (1, 3):
            await (await trainer.save(step, state(step))).wait()
        # an earlier run's save, cut short two hours ago by the index server's clock (begin() stamps the server's
        # time, which a test cannot turn back: the record is written as begin() would have written it then)
        index = trainer.store.index
        await index._hset("crash", 5, "created", repr(await index.now() - 7200), "target:disk", "0")
        old_session = incarnation_dir(index.identity, new_session())
        disk = trainer.store.io.driver("disk")
        await disk.write(PartKey("crash", 5, 0, 0, old_session).path, memoryview(bytes(5000)))
        faults(trainer.config).inject("stall", keys=step_dir(2))  # until cleared
        in_flight = await trainer.save(2, state(2))
        while 2 not in [s.step for s in await trainer.store.index.list("crash")]:
            await asyncio.sleep(0.01)  # begun in the index; its parts are held

        before = (redis_dump(server.url), tree(tmp_path / "disk"))
        assert await asyncio.to_thread(cli.main, ["-c", str(config), "gc", "--dry-run"]) == 0
        dry = capsys.readouterr().out
        assert (redis_dump(server.url), tree(tmp_path / "disk")) == before
        assert "a writer may be running" in dry and "step 2: incomplete" in dry and "index: would remove 1 " \
            "checkpoint(s): 5" in dry

        assert await asyncio.to_thread(cli.main, ["-c", str(config), "delete", "2"]) == 2
        assert "is being saved" in capsys.readouterr().err
        assert await asyncio.to_thread(cli.main, ["-c", str(config), "gc"]) == 0
        out = capsys.readouterr().out
        assert "index: removed 1 checkpoint(s): 5" in out and "4.88 KiB" in out
        assert await asyncio.to_thread(cli.main, ["-c", str(config), "delete", "1"]) == 0
        assert "deleted step 1" in capsys.readouterr().out

        faults(trainer.config).clear()
        await in_flight.wait()  # committed: neither gc nor delete fenced the trainer
        await (await trainer.save(4, state(4))).wait()
        assert [(c.step, sorted(c.complete)) async for c in trainer.list()] == [
            (2, ["disk"]), (3, ["disk"]), (4, ["disk"])]
        out2 = state(0)
        assert (await trainer.load(out2, step=2)).fallbacks == [] and torch.all(out2["w"] == 2)
    assert not [p for p in (tmp_path / "disk").rglob("*") if step_dir(5) in str(p) or step_dir(1) in str(p)]


async def test_list_from_the_tiers_reports_size_and_metadata_when_the_redis_index_is_down(tmp_path, shm_dir,
                                                                                         redis_server):
    server = redis_server()
    config = toml(tmp_path / "redis.toml", tmp_path, *host_and_disk(shm_dir), index=server.url)
    async with tc.Engine.from_toml(config) as engine:
        await (await engine.save(7, {"w": torch.ones(1000)}, metadata={"epoch": 3})).wait()
        server.stop()
        [status] = [c async for c in engine.list()]
    assert (status.step, status.nbytes, status.metadata, status.created > 0) == (7, 4000, {"epoch": 3}, True)
