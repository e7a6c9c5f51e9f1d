"""What a training loop relies on: mutation after save, lazy staging, backpressure, no memory growth,
plan cache without stale data, retention, visibility of incomplete checkpoints, failures that lose nothing."""
import asyncio
import os

import pytest
import torch

import tiered_ckpt as tc
from tiered_ckpt.layout import PartKey, parse_key, step_dir


def state_of(value: float, n: int = 50_000):
    return {"w": torch.full((n,), value), "b": torch.full((7, 3), value, dtype=torch.float64), "step": int(value)}


async def load_values(engine, step=None, tiers=None):
    out = state_of(-1.0)
    info = await engine.load(out, step=step, tiers=tiers)
    return info, out


async def test_mutation_right_after_save_does_not_leak(engine):
    state = state_of(1.0)
    handle = await engine.save(1, state)
    state["w"].fill_(99.0)  # the training loop moves on at once
    state["b"].mul_(5)
    await handle.wait()
    _, out = await load_values(engine)
    assert torch.all(out["w"] == 1.0) and torch.all(out["b"] == 1.0)


async def test_lazy_save_returns_before_copying_and_staged_guards_mutation(engine):
    state = state_of(2.0)
    handle = await engine.save(1, state, lazy=True)
    state["w"].fill_(3.0)  # before staged(): the copy has not run yet, so the checkpoint gets this value
    await handle.staged()
    state["w"].fill_(-5.0)  # after staged(): must not reach the checkpoint
    await handle.wait()
    _, out = await load_values(engine)
    assert torch.all(out["w"] == 3.0)


async def test_a_plain_save_returns_after_copying(engine):
    state = state_of(2.0)
    handle = await engine.save(1, state)
    state["w"].fill_(3.0)
    await handle.wait()
    _, out = await load_values(engine)
    assert torch.all(out["w"] == 2.0)


async def test_max_inflight_makes_the_next_save_wait_never_drop(make_config):
    # one buffer, a slow disk: save 2 must wait until save 1's parts are on the memory tier, then proceed
    # (with skip_when_behind = false every save reaches every tier, however far behind the disk is)
    async with tc.Engine(make_config(max_inflight=1, tiers=[{}, {"skip_when_behind": False}])) as engine:
        handles = []
        for step in range(1, 6):
            handles.append(await engine.save(step, state_of(float(step))))
        for h in handles:
            await h.wait()
        steps = [c.step for c in [c async for c in engine.list()] if c.complete == {"host", "disk"}]
        assert steps == [1, 2, 3, 4, 5]
        for step in range(1, 6):
            for tier in ("host", "disk"):
                _, out = await load_values(engine, step=step, tiers=[tier])
                assert torch.all(out["w"] == step), (step, tier)


async def test_detached_save_reads_back_from_the_faster_tier(make_config, monkeypatch):
    """A slow disk does not hold the staging buffer hostage: once save 1's parts are on the memory tier,
    save 2 takes the buffer (after the one disk write in progress) and disk reads the rest from memory."""
    async with tc.Engine(make_config(max_inflight=1, tiers=[{}, {"workers": 1}], stage_in_memory_tier=False)) as engine:
        disk, host = engine.tiers["disk"], engine.tiers["host"]
        write, read_into = disk.write, host.read_into
        read_back = []

        async def slow_write(key, data):
            await asyncio.sleep(0.2)
            return await write(key, data)

        async def counting_read_into(key, out):
            read_back.append(key)
            return await read_into(key, out)

        monkeypatch.setattr(disk, "write", slow_write)
        monkeypatch.setattr(host, "read_into", counting_read_into)
        h1 = await engine.save(1, state_of(1.0))  # 4 parts of 64 KiB
        h2 = await engine.save(2, state_of(2.0))
        assert not h1.done()  # save 2 got the buffer while save 1 was still streaming to disk
        await h1.wait()
        await h2.wait()
        assert read_back and all("step-000000000001" in k for k in read_back)
        for step in (1, 2):
            _, out = await load_values(engine, step=step, tiers=["disk"])
            assert torch.all(out["w"] == step)


async def test_staging_buffers_are_reused_not_grown(make_config):
    async with tc.Engine(make_config(stage_in_memory_tier=False)) as engine:
        seen = set()
        for step in range(1, 6):
            await engine.save(step, state_of(float(step)))
            await engine.wait_all()
            seen.update(id(b) for b in engine.pool._free)
            assert engine.pool._count == 1
        assert len(seen) == 1


async def test_the_staging_buffer_is_the_memory_tier_copy_and_retired_checkpoints_become_the_next_buffer(
        make_config, monkeypatch):
    """With a memory tier first (keep_last = 2, max_inflight = 1): save() copies into the memory tier's own
    part files (no part is written there through the driver), and once retention retires a checkpoint its
    files (same inodes: pages already allocated) stage a later save. Three buffers in all, for ten saves."""
    async with tc.Engine(make_config(tiers=[{"keep_last": 2}])) as engine:
        host = engine.tiers["host"]
        writes = []
        real_write = host.write

        async def counting_write(key, data):
            writes.append(key)
            return await real_write(key, data)

        monkeypatch.setattr(host, "write", counting_write)
        buffers, inodes = set(), {}
        for step in range(1, 11):
            await (await engine.save(step, state_of(float(step)))).wait()
            held = engine.pool._retained[step]
            buffers.add(id(held))
            keys = [k for k in await host.list(f"test/{step_dir(step)}/") if parse_key(k).kind == "part"]
            assert [host.path_of(k) for k in sorted(keys)] == held.parts.paths
            inodes[step] = {os.stat(p).st_ino for p in held.parts.paths}
        assert all(parse_key(k).kind != "part" for k in writes)  # only records and manifests went through write
        assert len(buffers) == 3 and inodes[10] == inodes[7]  # step 7's files, retired at step 9, hold step 10
        assert [c.step for c in await engine.statuses() if "host" in c.complete] == [9, 10]
        for step in (9, 10):
            _, out = await load_values(engine, step=step, tiers=["host"])
            assert torch.all(out["w"] == step)
    async with tc.Engine(make_config(tiers=[{"keep_last": 2}])) as engine:  # a restarted process
        _, out = await load_values(engine, tiers=["host"])
        assert torch.all(out["w"] == 10.0)


async def test_a_memory_tier_too_small_for_its_staging_buffers_is_refused(make_config):
    async with tc.Engine(make_config(tiers=[{"keep_last": 2, "capacity": "700KiB"}])) as engine:
        with pytest.raises(tc.ConfigError, match=r"tiers.host.capacity.*keep_last \+ 1 \+ max_inflight = 2 \+ 1 \+ 1"):
            await engine.save(1, state_of(1.0))  # 4 x ~200 KB
        assert [c async for c in engine.list()] == []


async def test_plan_cache_hits_and_never_writes_stale_data(engine):
    for step in range(1, 4):
        await (await engine.save(step, state_of(float(step)))).wait()
    assert engine.planner.misses == 1  # same structure: one plan
    for step in range(1, 4):
        _, out = await load_values(engine, step=step)
        assert torch.all(out["w"] == step) and out["step"] == step
    await (await engine.save(4, {**state_of(4.0), "w": torch.full((10,), 4.0)})).wait()  # shape change
    assert engine.planner.misses == 2


async def test_existing_step_is_refused_and_nothing_is_lost(engine):
    await (await engine.save(1, state_of(1.0))).wait()
    await engine.wait_all()  # not merely in flight: done
    with pytest.raises(tc.CheckpointExists, match="already exists"):
        await engine.save(1, state_of(2.0))
    _, out = await load_values(engine)
    assert torch.all(out["w"] == 1.0)


async def test_keep_last_and_every(make_config):
    cfg = make_config(tiers=[{"keep_last": 2}, {"keep_last": 2, "every": 2}])
    async with tc.Engine(cfg) as engine:
        for step in range(1, 8):
            await (await engine.save(step, state_of(float(step)))).wait()
        listing = {c.step: c.complete for c in [c async for c in engine.list()]}
        assert listing == {4: {"disk"}, 6: {"host", "disk"}, 7: {"host"}}
        on_disk = sorted({k.split("/")[1] for k in await engine.tiers["disk"].list("test/")})
        assert on_disk == ["step-000000000004", "step-000000000006"]


async def test_a_failed_tier_leaves_earlier_checkpoints_intact(make_config):
    cfg = make_config(tiers=[{"capacity": "300KiB"}], stage_in_memory_tier=False)  # parts written, not staged there
    async with tc.Engine(cfg) as engine:
        await (await engine.save(1, state_of(1.0))).wait()  # ~200 KiB: fits
        handle = await engine.save(2, state_of(2.0))  # does not fit next to step 1 on host
        with pytest.raises(tc.SaveError) as err:
            await handle.wait()
        assert set(err.value.errors) == {"host"} and isinstance(err.value.errors["host"], tc.TierFull)
        await handle.wait("disk")  # the disk tier still completed
        listing = {c.step: c for c in [c async for c in engine.list()]}
        assert listing[2].complete == {"disk"} and "host" in listing[2].failed
        _, out = await load_values(engine, step=1, tiers=["host"])
        assert torch.all(out["w"] == 1.0)
        info, out = await load_values(engine)
        assert info.step == 2 and info.tier == "disk" and torch.all(out["w"] == 2.0)


async def test_unobserved_background_error_is_raised_at_close(make_config):
    engine = await tc.Engine(make_config(tiers=[{"capacity": "100KiB"}], stage_in_memory_tier=False)).open()
    await engine.save(1, state_of(1.0))
    with pytest.raises(tc.SaveError, match="host"):
        await engine.close()


async def test_incomplete_checkpoint_is_listed_but_never_loaded(engine):
    await (await engine.save(1, state_of(1.0))).wait()
    await engine.index.begin("test", 2, ["host", "disk"])  # a save that never finished
    await engine.tiers["host"].write(PartKey("test", 2, 0, 0).path, memoryview(b"junk"))
    listing = [c async for c in engine.list()]
    assert [(c.step, c.is_complete) for c in listing] == [(1, True), (2, False)]
    info, _ = await load_values(engine)
    assert info.step == 1
    with pytest.raises(tc.IncompleteCheckpoint, match="step 2 is incomplete"):
        await load_values(engine, step=2)
    # saving step 2 again clears the leftovers of the failed attempt
    await (await engine.save(2, state_of(2.0))).wait()
    info, out = await load_values(engine)
    assert info.step == 2 and torch.all(out["w"] == 2.0)


async def test_delete_removes_index_entry_and_tier_data(engine):
    for step in (1, 2):
        await (await engine.save(step, state_of(float(step)))).wait()
    await engine.delete(2)
    assert [c.step async for c in engine.list()] == [1]
    assert not [k for k in await engine.tiers["disk"].list("test/") if "step-000000000002" in k]
    with pytest.raises(tc.IncompleteCheckpoint):
        await engine.delete(2)


async def test_load_with_nothing_saved_is_a_clear_error(engine):
    with pytest.raises(tc.IncompleteCheckpoint, match="no complete checkpoint"):
        await load_values(engine)


async def test_state_with_no_tensors_and_metadata(engine):
    await (await engine.save(5, {"epoch": 3, "note": "x"}, metadata={"git": "abc"})).wait()
    state = {"epoch": 0, "note": ""}
    await engine.load(state)
    assert state == {"epoch": 3, "note": "x"}
    manifest = await engine.read_manifest(5)
    assert manifest.metadata == {"git": "abc"}


async def test_restarted_process_loads_from_memory_tier(make_config):
    cfg = make_config()
    async with tc.Engine(cfg) as engine:
        await (await engine.save(1, state_of(1.0))).wait()
    async with tc.Engine(cfg) as engine:  # a new engine: nothing cached in this process
        info, out = await load_values(engine)
        assert info.tier == "host" and torch.all(out["w"] == 1.0)
        with pytest.raises(tc.CheckpointExists):
            await engine.save(1, state_of(1.0))


async def test_retention_spares_a_checkpoint_being_loaded(make_config, monkeypatch):
    """A load of step 1 is held inside its read of step 1's parts while saves 2 and 3 run retention with
    keep_last = 1: step 1 must survive until the load is done, and the load must return step 1 intact."""
    async with tc.Engine(make_config(tiers=[{"keep_last": 1}, {"keep_last": 1}])) as engine:
        await (await engine.save(1, state_of(1.0))).wait()
        host = engine.tiers["host"]
        real_read, reading, release = host.read_mapped, asyncio.Event(), asyncio.Event()

        async def held_read(key, use):  # the memory tier's load path: verify in place, copy once
            if "step-000000000001/" in key and key.endswith("rank-00000/part-000000"):  # hold one read (one worker slot)
                reading.set()
                await release.wait()
            return await real_read(key, use)

        monkeypatch.setattr(host, "read_mapped", held_read)
        loading = asyncio.create_task(load_values(engine, step=1, tiers=["host"]))
        await reading.wait()
        for step in (2, 3):
            await (await engine.save(step, state_of(float(step)))).wait()
        assert [c.step async for c in engine.list()] == [1, 3]  # 2 retired, 1 spared while it is read
        release.set()
        info, out = await loading
        assert info.step == 1 and torch.all(out["w"] == 1.0)
        await (await engine.save(4, state_of(4.0))).wait()
        assert [c.step async for c in engine.list()] == [4]  # once the load is done, retention takes it


async def test_max_inflight_backpressure_holds_the_next_save_until_a_buffer_frees(make_config, monkeypatch):
    """With max_inflight = 1 and both tiers held, save 2 cannot take the only staging buffer: save() waits
    (it neither drops the save nor allocates a second buffer) until a tier holds save 1's parts."""
    async with tc.Engine(make_config(max_inflight=1)) as engine:
        release = asyncio.Event()
        for tier in engine.tiers.values():
            real_write = tier.write

            async def held_write(key, data, real_write=real_write):
                await release.wait()
                return await real_write(key, data)

            monkeypatch.setattr(tier, "write", held_write)
        h1 = await engine.save(1, state_of(1.0))
        second = asyncio.create_task(engine.save(2, state_of(2.0)))
        await asyncio.sleep(0.3)
        assert not second.done() and engine.pool._count == 1
        release.set()
        h2 = await second
        await h1.wait()
        await h2.wait()
        for step in (1, 2):
            _, out = await load_values(engine, step=step)
            assert torch.all(out["w"] == step)


async def test_a_save_that_fails_on_a_full_tier_gives_its_room_back(make_config, shm_dir):
    """The memory tier fills up part-way through save 1 (capacity): the parts it did write are removed, so
    save 2, which fits, succeeds there; without that, every later save to the tier would fail too."""
    async with tc.Engine(make_config(tiers=[{"capacity": "300KiB"}], stage_in_memory_tier=False)) as engine:
        big = {"w": torch.ones(100_000)}  # 400 KB: does not fit
        with pytest.raises(tc.SaveError, match=r"host.*TierFull"):
            await (await engine.save(1, big)).wait()
        assert sum(f.stat().st_size for f in (shm_dir / "host").rglob("*") if f.is_file()) == 0
        await (await engine.save(2, {"w": torch.ones(50_000)})).wait()  # 200 KB
        assert (await engine.status(2)).complete == {"host", "disk"}


async def test_a_deletion_cut_short_never_brings_the_checkpoint_back_and_is_finished(make_config, shm_dir):
    """A crash inside delete(1): the tombstone and the index removal happened, the data did not. The tiers'
    manifests must not resurrect step 1, and the next writer removes its data."""
    config = make_config()
    async with tc.Engine(config) as engine:
        await (await engine.save(1, state_of(1.0))).wait()
        await engine.index.bury(engine.job, 1)  # what delete() does first...
        await engine.index.delete(engine.job, 1)  # ...and second; then the process dies
    leftovers = lambda: sorted(p.name for p in (shm_dir / "host" / "test").iterdir())  # noqa: E731
    assert leftovers() == ["step-000000000001"]
    async with tc.Engine(config) as engine:
        with pytest.raises(tc.IncompleteCheckpoint):
            await load_values(engine)  # the manifests on the tiers are not taken: step 1 is buried
        await (await engine.save(2, state_of(2.0))).wait()  # the writer finishes the removal
        assert leftovers() == ["step-000000000002"] and await engine.index.buried(engine.job) == set()
        assert [c.step async for c in engine.list()] == [2]


async def test_a_lost_or_garbled_newest_record_is_reported_not_silently_rolled_back(engine, tmp_path, caplog):
    import logging

    for step in (1, 2, 3):
        await (await engine.save(step, state_of(float(step)))).wait()
    await engine.index.delete(engine.job, 3)  # the newest record lost
    (tmp_path / "index" / "test" / "step-000000000002" / "begun").write_bytes(b"\x00garbage")  # one garbled
    caplog.set_level(logging.WARNING)
    info, out = await load_values(engine)
    assert info.step == 1 and torch.all(out["w"] == 1.0)
    assert "step 2" in caplog.text and "cannot be read" in caplog.text  # the garbled record, named
    assert "manifest of step 2" in caplog.text and "manifest of step 3" in caplog.text  # both, still on the tiers
    status = {c.step: c for c in [c async for c in engine.list()]}
    assert "index" in status[2].failed and not status[2].is_complete
    info, out = await load_values(engine, step=3)  # and either can still be loaded explicitly
    assert info.step == 3 and torch.all(out["w"] == 3.0)


async def test_unrelated_runs_sharing_a_memory_path_and_job_name_keep_their_own_bytes(tmp_path, make_config):
    """Two runs in different directories (two file indexes) use the same /dev/shm path and job name. The
    second one's saves and retention of the same step numbers neither overwrite nor delete the first's."""
    first = make_config(tiers=[{"keep_last": 1}])
    second = make_config(tiers=[{"keep_last": 1}, {"path": str(tmp_path / "disk2")}], index=f"file://{tmp_path}/index2")
    async with tc.Engine(first) as a:
        await (await a.save(1, state_of(1.0))).wait()
        async with tc.Engine(second) as b:
            for step in (1, 2):
                await (await b.save(step, state_of(10.0 + step))).wait()  # retires b's step 1 on host
        info, out = await load_values(a, tiers=["host"])
        assert info.step == 1 and torch.all(out["w"] == 1.0) and not info.fallbacks


async def test_with_the_index_lost_the_newest_whole_incarnation_of_a_step_is_loaded(tmp_path, make_config):
    """Step 1 saved twice, by two openings, the index lost in between and after: the tiers hold two folders
    of step 1, and a load from the tiers takes the newer one."""
    import shutil

    config = make_config()
    for value in (1.0, 2.0):
        async with tc.Engine(config) as engine:
            await (await engine.save(1, state_of(value))).wait()
        shutil.rmtree(tmp_path / "index")
    async with tc.Engine(config) as engine:
        assert len({p.incarnation for p in map(parse_key, await engine.tiers["disk"].list("test/")) if p}) == 2
        info, out = await load_values(engine)
        assert info.step == 1 and torch.all(out["w"] == 2.0)


async def test_a_tier_that_cannot_keep_up_skips_to_the_newest_and_retention_holds_during_a_burst(make_config,
                                                                                              monkeypatch):
    """30 saves in a row with keep_last = 2 and a disk far slower than the saves: the disk skips saves that
    a newer one superseded while they waited (reported in the handle and in list()), jobs in flight stay
    bounded, and the disk never holds more than keep_last complete checkpoints plus those committing."""
    async with tc.Engine(make_config(tiers=[{"keep_last": 2}, {"keep_last": 2}])) as engine:
        disk = engine.tiers["disk"]

        async def slow_write(key, data, real_write=disk.write):
            await asyncio.sleep(0.01)
            return await real_write(key, data)

        monkeypatch.setattr(disk, "write", slow_write)
        handles, most_jobs, most_on_disk = [], 0, 0
        for step in range(1, 31):
            handles.append(await engine.save(step, state_of(float(step))))
            most_jobs = max(most_jobs, len(engine._jobs))
            most_on_disk = max(most_on_disk, sum("disk" in c.complete for c in await engine.statuses()))
        for h in handles:
            await h.wait()  # skipping is not an error
        skipped = {h.step: h.skipped["disk"] for h in handles if "disk" in h.skipped}
        assert skipped and all(newer > step for step, newer in skipped.items()), skipped
        assert not any(h.skipped.get("host") for h in handles[-1:]) and handles[-1].skipped == {}
        assert most_jobs <= engine.config.engine.max_inflight + 2 * 2, most_jobs
        assert most_on_disk <= 2 + 2, most_on_disk  # keep_last, and the saves whose retention pass is next
        listing = [c async for c in engine.list()]
        assert [c.step for c in listing if "disk" in c.complete] == [29, 30] or \
            [c.step for c in listing if "disk" in c.complete][-1] == 30
        assert all(c.skipped["disk"] > c.step for c in listing if "disk" in c.tiers and "disk" not in c.complete)
        _, out = await load_values(engine, tiers=["disk"])
        assert torch.all(out["w"] == 30.0)
        # once the burst is over, no tier holds more than keep_last (passes that spared busy steps came back)
        statuses = await engine.statuses()
        assert all(sum(t in c.complete for c in statuses) <= 2 for t in ("host", "disk")), statuses


@pytest.mark.parametrize("while_staging", [False, True])
async def test_part_checksums_are_the_same_whether_hashed_during_or_after_the_copy(make_config, monkeypatch,
                                                                                    while_staging):
    """Parts are hashed as soon as they are staged on machines with spare cores, after the copy elsewhere:
    the recorded checksums are those of the staged bytes either way (many chunks, several parts)."""
    import tiered_ckpt.save.job as saving
    from tiered_ckpt.checksum import checksum

    monkeypatch.setattr(saving, "HASH_WHILE_STAGING", while_staging)
    state = {f"t{i}": torch.randn(3000 + 17 * i) for i in range(40)}  # ~500 KB: 8 parts of 64 KiB
    async with tc.Engine(make_config()) as engine:
        await (await engine.save(1, state)).wait()
        manifest = await engine.read_manifest(1)
        host = engine.tiers["host"]
        expected = [checksum([memoryview(await host.read(PartKey("test", 1, 0, p, engine.incarnation).path))],
                             manifest.checksum) for p in range(len(manifest.ranks[0].checksums))]
        assert list(manifest.ranks[0].checksums) == expected and len(expected) >= 8
        out = {k: torch.zeros_like(v) for k, v in state.items()}
        await engine.load(out, tiers=["disk"])
        assert all(torch.equal(out[k], v) for k, v in state.items())


async def test_staging_buffers_of_a_dead_process_are_removed_at_the_next_open(make_config, shm_dir):
    """A process killed mid-save leaves its staging files in the memory tier's .staging folder (RAM). A live
    process holds a flock on its folder's .owner file; the next engine of the job removes, at its first save,
    the folders nobody holds (whatever their PIDs say: PIDs are reused), and keeps a live one's."""
    import fcntl

    staging = shm_dir / "host" / ".staging"
    gone, alive = staging / "test-0123456789abcdef-r0-somehost-p2", staging / "test-fedcba9876543210-r0-somehost-p2"
    for folder in (gone, alive):
        (folder / "buf-0").mkdir(parents=True)
        (folder / "buf-0" / "part-000000").write_bytes(b"x" * 4096)
        (folder / ".owner").touch()
    holder = os.open(alive / ".owner", os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX)  # as its (live) process does
    try:
        async with tc.Engine(make_config()) as engine:
            assert gone.exists()  # opening changes nothing on the tier
            await (await engine.save(1, state_of(1.0))).wait()
            assert not gone.exists() and alive.exists()
            assert any(staging.glob("test-*-p*/.owner")) and len(list(staging.iterdir())) == 2
        assert len(list(staging.iterdir())) == 1  # close() removed this engine's own folder
    finally:
        os.close(holder)


async def test_a_full_tmpfs_stages_in_anonymous_memory_and_the_save_goes_on(make_config, monkeypatch):
    """Preallocating the memory tier's staging files fails (tmpfs full): save() does not raise; it stages in
    anonymous memory and both tiers still get the checkpoint."""
    import errno

    import tiered_ckpt.save.mapped as mapped

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(mapped.os, "posix_fallocate", full)
    async with tc.Engine(make_config()) as engine:
        handle = await engine.save(1, state_of(1.0))
        await handle.wait()
        assert engine.pool.arena is not None and not engine.pool._retained  # the fallback buffer is anonymous
        for tier in ("host", "disk"):
            _, out = await load_values(engine, tiers=[tier])
            assert torch.all(out["w"] == 1.0)


async def test_retention_never_removes_another_runs_write_in_progress(tmp_path, make_config):
    """Another run (another index) is writing step 1 under the same memory-tier path and job: its temp file,
    which listings do not show, survives this run's retention of its own step 1."""
    other = make_config(index=f"file://{tmp_path}/other-index")
    async with tc.Engine(other) as engine:
        theirs = engine.tiers["host"].path_of(f"test/{step_dir(1)}/{engine.incarnation}/rank-00000/.tmp-part-000000.x")
    theirs.parent.mkdir(parents=True)
    theirs.write_bytes(b"half a part")
    async with tc.Engine(make_config(tiers=[{"keep_last": 1}])) as engine:
        for step in (1, 2):
            await (await engine.save(step, state_of(float(step)))).wait()
        assert [c.step for c in await engine.statuses() if "host" in c.complete] == [2]
    assert theirs.read_bytes() == b"half a part"


async def test_a_commit_whose_reply_was_lost_keeps_its_parts(make_config, monkeypatch):
    """The index runs the commit, then the connection fails before the reply (IndexUnavailable): the save
    fails on that tier, but the tier may be complete in the index, so its parts must stay and load."""
    from tiered_ckpt.errors import IndexUnavailable

    async with tc.Engine(make_config(stage_in_memory_tier=False)) as engine:
        real = engine.index.mark_durable

        async def reply_lost(job, step, tier, *args):
            await real(job, step, tier, *args)
            if tier == "disk":
                raise IndexUnavailable("connection reset after the commit ran")
            return True

        monkeypatch.setattr(engine.index, "mark_durable", reply_lost)
        with pytest.raises(tc.SaveError, match="disk"):
            await (await engine.save(1, state_of(1.0))).wait()
        assert [sorted(c.complete) for c in await engine.statuses()] == [["disk", "host"]]
        _, out = await load_values(engine, tiers=["disk"])
        assert torch.all(out["w"] == 1.0)


async def test_slower_tiers_start_once_the_staging_memory_tier_is_marked_durable(make_config, monkeypatch):
    """When the staging buffer is the memory tier's files, the disk writes start only after this rank marked
    the memory tier durable: a file index's fsyncs would otherwise queue behind the disk's writeback."""
    async with tc.Engine(make_config()) as engine:
        order = []
        real_mark, real_write = engine.index.mark_durable, engine.tiers["disk"].write

        async def mark(job, step, tier, *args):
            order.append(f"mark {tier}")
            return await real_mark(job, step, tier, *args)

        async def write(key, data):
            order.append("disk write")
            return await real_write(key, data)

        monkeypatch.setattr(engine.index, "mark_durable", mark)
        monkeypatch.setattr(engine.tiers["disk"], "write", write)
        await (await engine.save(1, state_of(1.0))).wait()
        assert order.index("mark host") < order.index("disk write"), order
