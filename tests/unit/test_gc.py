"""`gc` (Engine.gc, tiered-ckpt gc) on the file index, and list()'s size and metadata. Leftovers are made the
way crashed runs make them: real saves, then keys written with the layout's functions under other sessions
(a zombie, a crashed attempt), index records cut short, temp files. tests/integration/test_gc.py kills a
saving process and runs gc beside a trainer on the Redis index."""
import asyncio
import json
import os
import shutil
import time
from pathlib import Path

import msgpack
import pytest
import torch

import tiered_ckpt as tc
from tiered_ckpt import cli
from tiered_ckpt.checksum import seal, unseal
from tiered_ckpt.testing.configs import faults, stack, stack_dict, write_toml
from tiered_ckpt.layout import PartKey, incarnation_dir, manifest_key, new_session, step_dir

from .common import wait_until

DATA = Path(__file__).parent.parent / "data" / "format2"


def state(value: float) -> dict:
    return {"w": torch.full((50_000,), float(value)), "extra": {"lr": 3e-4}}


def tree(*roots: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under `roots` with its size and mtime: what 'changes nothing' compares."""
    out = {}
    for root in roots:
        for dirpath, dirs, files in os.walk(root):
            for name in dirs + files:
                st = os.lstat(os.path.join(dirpath, name))
                out[os.path.join(dirpath, name)] = (st.st_size if name in files else 0, st.st_mtime_ns)
    return out


def age_begun_record(index_root: Path, job: str, step: int, seconds: float) -> None:
    """Make the file index's record of `step` say its save began `seconds` ago (a run that crashed then): its
    time in the record and the file's own (which tells a save begun before the live writer's lease)."""
    path = index_root / job / step_dir(step) / "begun"
    record = msgpack.unpackb(unseal(path.read_bytes(), str(path)))
    record["created"] = then = time.time() - seconds
    path.write_bytes(seal(msgpack.packb(record)))
    os.utime(path, (then, then))


async def test_gc_removes_zombie_folders_old_temp_files_and_empty_folders_and_dry_run_changes_nothing(
        make_config, tmp_path, shm_dir):
    async with tc.Engine(make_config()) as engine:
        for step in (1, 2):
            await (await engine.save(step, state(step))).wait()
        identity = engine.store.index.identity
        zombie = incarnation_dir(identity, new_session())  # a fenced writer that kept writing step 1
        for tier, size in (("host", 3000), ("disk", 5000)):
            await engine.store.io.driver(tier).write(PartKey("test", 1, 0, 0, zombie).path, memoryview(bytes(size)))
            await engine.store.io.driver(tier).write(manifest_key("test", 1, zombie), memoryview(b"m" * 10))
        other = "ix-0badcafe/" + new_session()  # an unrelated run (its own index) sharing the path and job
        await engine.store.io.driver("host").write(PartKey("test", 1, 0, 0, other).path, memoryview(bytes(700)))
    host, disk, index = shm_dir / "host", tmp_path / "disk", tmp_path / "index"
    committed = next(p for p in (host / "test" / step_dir(2)).rglob("part-000000"))
    old = time.time() - 7200
    stale = committed.with_name(".tmp-part-000001.deadbeef")  # a write cut short two hours ago
    stale.write_bytes(bytes(1234))
    os.utime(stale, (old, old))
    fresh = committed.with_name(".tmp-part-000002.cafecafe")  # a write that may be running now
    fresh.write_bytes(bytes(99))
    empty = disk / "test" / step_dir(9) / "ix-00000000"
    empty.mkdir(parents=True)
    for path in (empty, empty.parent):
        os.utime(path, (old, old))

    async with tc.Engine(make_config()) as engine:
        before = tree(host, disk, index)
        dry = await engine.gc(dry_run=True)
        assert tree(host, disk, index) == before  # nothing changed, not even a lease file
        real = await engine.gc()
    assert dry.dry_run and dry.exclusive and real.exclusive and not real.errors
    assert [(r.tier, r.name, r.nbytes) for r in dry.removed] == [(r.tier, r.name, r.nbytes) for r in real.removed]
    freed = real.freed()
    assert freed["host"] == (2, 3010 + 1234, False)  # the zombie's folder, the stale temp file
    assert freed["disk"] == (2, 5010, False)  # the zombie's folder, the empty step folder
    assert real.checkpoints == [] and any("0badcafe" in line for line in real.kept)
    assert not stale.exists() and fresh.exists() and not (disk / "test" / step_dir(9)).exists()
    for root in (host, disk):
        assert not [p for p in root.rglob("*") if zombie in str(p)]
    assert [p for p in host.rglob("*") if "0badcafe" in str(p)]  # another index's folder stays

    async with tc.Engine(make_config()) as engine:
        for tier in ("host", "disk"):
            out = state(0)
            info = await engine.load(out, step=1, tiers=[tier])
            assert info.fallbacks == [] and torch.all(out["w"] == 1)
        assert [(c.step, sorted(c.complete)) async for c in engine.list()] == [(1, ["disk", "host"]),
                                                                              (2, ["disk", "host"])]
        again = await engine.gc()
        assert [r.name for r in again.removed] == []
        foreign = await engine.gc(other_indexes=True)
        assert [r.nbytes for r in foreign.removed] == [700]
    assert not [p for p in host.rglob("*") if "0badcafe" in str(p)]


async def test_gc_finishes_removals_cut_short_removes_partial_orphans_and_keeps_whole_ones(make_config, tmp_path):
    async with tc.Engine(make_config()) as engine:
        for step in (1, 2, 3):
            await (await engine.save(step, state(step))).wait()
        await engine.store.index.bury("test", 2)  # a delete that crashed after dropping the record, before the data
        await engine.store.index.delete("test", 2)
        await engine.store.index.delete("test", 3)  # a lost record: the tiers hold the only copy
        lost = incarnation_dir(engine.store.index.identity, new_session())
        disk = engine.store.io.driver("disk")
        await disk.write(PartKey("test", 7, 0, 0, lost).path, memoryview(bytes(321)))  # no manifest
        report = await engine.gc()  # this engine is the writer: no other writer can run
        assert report.exclusive and report.checkpoints == [2] and not report.errors
        assert await engine.store.index.buried("test") == set()
        keys = {t: await engine.store.io.driver(t).list("test/") for t in ("host", "disk")}
        assert not [k for ks in keys.values() for k in ks if step_dir(2) in k or step_dir(7) in k]
        assert [k for k in keys["disk"] if step_dir(3) in k]
        assert any("step 3" in line and "load(step=3)" in line for line in report.kept)
        out = state(0)
        assert (await engine.load(out, step=3)).step == 3 and torch.all(out["w"] == 3)
    assert not (tmp_path / "disk" / "test" / step_dir(7)).exists()


async def test_gc_beside_a_live_writer_keeps_its_save_in_flight_and_removes_old_crashed_saves(
        make_config, tmp_path, shm_dir):
    """The file index's lease is held by a running trainer: gc cannot rule out a writer, so it keeps what a
    save may still be writing (step 2, complete on host, still writing disk) and removes only incomplete
    saves older than the grace period (step 5, although newer than every complete one). The trainer's save
    then completes and loads; `tiered-ckpt delete` refuses the step while it is in flight."""
    config = write_toml(tmp_path / "c.toml", stack_dict(tmp_path, {"kind": "memory", "capacity": "1GiB"}, "local",
                                                        shm=shm_dir))
    async with tc.Engine(make_config(tiers=[{}, {"kind": "faulty"}])) as writer:
        await (await writer.save(1, state(1))).wait()
        await writer.store.index.begin("test", 5, ["host", "disk"])  # a save of an earlier run that crashed 2 h ago
        age_begun_record(tmp_path / "index", "test", 5, 7200)
        crashed = incarnation_dir(writer.store.index.identity, new_session())
        await writer.store.io.driver("host").write(PartKey("test", 5, 0, 0, crashed).path, memoryview(bytes(4096)))
        disk = faults(writer.config)
        disk.inject("stall", keys=step_dir(2))  # until cleared
        in_flight = await writer.save(2, state(2))
        await in_flight.wait("host")
        assert await asyncio.to_thread(cli.main, ["-c", str(config), "delete", "2"]) == 2

        async with tc.Engine(make_config()) as cleaner:
            report = await cleaner.gc()
        assert not report.exclusive and report.checkpoints == [5] and not report.errors
        assert any(line.startswith("step 2 on disk") for line in report.kept)
        assert all(r.step != 2 for r in report.removed)
        assert not [k for k in await writer.store.io.driver("host").list("test/") if step_dir(5) in k]
        disk.clear()
        await in_flight.wait()
        await (await writer.save(3, state(3))).wait()
        assert [(c.step, sorted(c.complete)) async for c in writer.list()] == [
            (1, ["disk", "host"]), (2, ["disk", "host"]), (3, ["disk", "host"])]
        out = state(0)
        info = await writer.load(out, step=2, tiers=["disk"])
        assert info.fallbacks == [] and torch.all(out["w"] == 2)


async def test_gc_holds_the_lease_while_it_runs_and_a_writer_waits_for_it(make_config):
    from tiered_ckpt.storage.index.file import FileIndex

    async with tc.Engine(make_config()) as first:
        await (await first.save(1, state(1))).wait()
    root = Path(make_config().engine.index.removeprefix("file://"))
    cleaner, writer = FileIndex(root), FileIndex(root)
    await cleaner.open()
    await writer.open()
    assert await cleaner.attach("test", hold=False) is True  # only tested: a writer may fence at once
    await writer.fence("test")
    assert await cleaner.attach("test", hold=False) is False
    await writer.close()
    assert await cleaner.attach("test") is True  # held now, marked as a cleaner's
    second = FileIndex(root)
    await second.open()
    fencing = asyncio.create_task(second.fence("test"))
    await wait_until(lambda: second.waiting_for_cleaner, what="the writer's fence meeting the cleaner's lease")
    assert not fencing.done()  # the writer's first save waits for the cleaner ...
    await cleaner.detach("test")
    await asyncio.wait_for(fencing, 10)  # ... and goes on once it is done
    await cleaner.close()
    await second.close()
    async with tc.Engine(make_config()) as reader:  # gc on a long-lived reader: the lease ends with the gc
        assert (await reader.gc()).exclusive
        third = FileIndex(root)
        await third.open()
        await asyncio.wait_for(third.fence("test"), 1)  # no wait for the reader to close
        await third.close()


@pytest.mark.parametrize("kind", ["file", "redis"])
async def test_list_reports_each_checkpoints_size_and_metadata_without_reading_manifests(kind, make_config,
                                                                                         request, tmp_path):
    engine_keys = {}
    if kind == "redis":
        engine_keys["index"] = request.getfixturevalue("redis_server")().url
    async with tc.Engine(make_config(**engine_keys)) as engine:
        await (await engine.save(10, state(1), metadata={"name": "warmup"})).wait()
        await (await engine.save(20, {**state(2), "more": torch.ones(1000)},
                                 metadata={"name": "best", "loss": 1.5})).wait()
        sizes = [(await engine.read_manifest(s)).nbytes for s in (10, 20)]
        # remove the manifests from the index: list() must not need them
        if kind == "file":
            for step in (10, 20):
                (tmp_path / "index" / "test" / step_dir(step) / "manifest").unlink()
        else:
            import redis.asyncio as aioredis

            client = aioredis.Redis.from_url(engine_keys["index"])  # the stored layout: tiered_ckpt:idx:<job>:...
            for step in (10, 20):
                assert await client.hdel(f"tiered_ckpt:idx:test:step:{step}", "manifest") == 1
            await client.aclose()
        listed = [(c.step, c.nbytes, c.metadata) async for c in engine.list()]
        assert listed == [(10, sizes[0], {"name": "warmup"}), (20, sizes[1], {"name": "best", "loss": 1.5})]
        assert sizes[0] == 200_000 and sizes[1] >= 204_000  # 50k float32; and 1k more (aligned)
        assert (await engine.status(20)).metadata == {"name": "best", "loss": 1.5}
    with tc.Checkpointer(make_config(**engine_keys)) as ckpt:
        assert [(c.step, c.nbytes) for c in ckpt.list()] == [(10, sizes[0]), (20, sizes[1])]
        assert ckpt.gc(dry_run=True).removed == []


async def test_an_earlier_releases_checkpoint_lists_its_size_and_gc_keeps_it(tmp_path):
    root = tmp_path / "format2"
    shutil.copytree(DATA, root)
    config = stack(root, "local", job="old")
    async with tc.Engine(config) as engine:
        [status] = [c async for c in engine.list()]
        assert status.step == 3 and status.nbytes == (await engine.read_manifest(3)).nbytes > 0
        report = await engine.gc()
        assert report.removed == [] and report.checkpoints == []
        out = {"w": torch.zeros(40_000), "b": torch.zeros(10, dtype=torch.int64), "extra": {"lr": None}}
        assert (await engine.load(out)).step == 3 and out["extra"] == {"lr": 0.5}


def test_gc_drops_an_unreadable_record_once_no_tier_holds_its_step_and_keeps_it_while_one_does(tmp_path, shm_dir,
                                                                                              capsys):
    """#31 F1: step 2's `begun` record is torn (a truncated file), then retention removes its data: the record
    promises nothing any more, yet it was listed as "incomplete, cannot be read" (warned about by every command)
    and gc kept it for ever, saying load(step=2) might restore it. gc removes it now; a torn record whose step a
    tier still holds (step 4) stays, and gc says where its data is."""
    config = write_toml(tmp_path / "c.toml", stack_dict(tmp_path, {"kind": "memory", "keep_last": 2},
                                                        {"kind": "local", "keep_last": 2}, shm=shm_dir))

    def tear(step: int) -> None:
        begun = tmp_path / "index" / "test" / step_dir(step) / "begun"
        begun.write_bytes(begun.read_bytes()[:7])

    async def train(steps, torn_after: int) -> None:
        async with tc.Engine.from_toml(config) as engine:
            for step in steps:
                await (await engine.save(step, state(step))).wait()
                if step == torn_after:
                    tear(step)

    asyncio.run(train([1, 2, 3, 4, 5], torn_after=2))  # retention removes step 2's folders from both tiers
    assert not [p for root in (shm_dir / "host", tmp_path / "disk") for p in root.rglob("*") if step_dir(2) in str(p)]
    tear(4)  # torn too, but both tiers still hold step 4
    assert cli.main(["-c", str(config), "gc", "--dry-run", "--json"]) == 0
    dry = json.loads(capsys.readouterr().out)
    assert dry["checkpoints"] == [2] and [(r["tier"], r["step"]) for r in dry["removed"]] == [(None, 2)]
    assert not any("step 2" in line for line in dry["kept"])
    [kept] = [line for line in dry["kept"] if line.startswith("step 4")]
    assert "cannot be read" in kept and "tier(s) host, disk still hold data of it" in kept
    assert cli.main(["-c", str(config), "gc", "--json"]) == 0
    real = json.loads(capsys.readouterr().out)
    assert real["checkpoints"] == [2] and real["errors"] == [] and real["kept"] == dry["kept"]
    assert cli.main(["-c", str(config), "ls", "--json"]) == 0
    listed = {c["step"]: c for c in json.loads(capsys.readouterr().out)["checkpoints"]}
    assert sorted(listed) == [4, 5] and listed[4]["complete"] is False  # step 4's record stays, unreadable
    assert not (tmp_path / "index" / "test" / step_dir(2)).exists()
    assert cli.main(["-c", str(config), "gc", "--json"]) == 0  # nothing more to do, and no error
    again = json.loads(capsys.readouterr().out)
    assert again["checkpoints"] == [] and again["removed"] == []
