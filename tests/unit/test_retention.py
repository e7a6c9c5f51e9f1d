"""Retention and removal: keep_last and every, busy steps spared, bursts that skip a slow tier, other runs'
bytes untouched, deletions (cut short too), and a tier whose delete hangs."""
import asyncio
import os

import pytest
import torch

import tiered_ckpt as tc
from tiered_ckpt.layout import step_dir
from tiered_ckpt.testing.configs import faults

from .common import load_values, state_of


async def test_keep_last_and_every(make_config):
    cfg = make_config(tiers=[{"keep_last": 2}, {"keep_last": 2, "every": 2}])
    async with tc.Engine(cfg) as engine:
        for step in range(1, 8):
            await (await engine.save(step, state_of(float(step)))).wait()
        listing = {c.step: c.complete for c in [c async for c in engine.list()]}
        assert listing == {4: {"disk"}, 6: {"host", "disk"}, 7: {"host"}}
        on_disk = sorted({k.split("/")[1] for k in await engine.store.io.driver("disk").list("test/")})
        assert on_disk == ["step-000000000004", "step-000000000006"]


async def test_retention_spares_a_checkpoint_being_loaded(make_config, monkeypatch):
    """A load of step 1 is held inside its read of step 1's parts while saves 2 and 3 run retention with
    keep_last = 1: step 1 must survive until the load is done, and the load must return step 1 intact."""
    async with tc.Engine(make_config(tiers=[{"keep_last": 1}, {"keep_last": 1}])) as engine:
        await (await engine.save(1, state_of(1.0))).wait()
        host = engine.store.io.driver("host")
        real_read, reading, release = host.read_chunks, asyncio.Event(), asyncio.Event()

        async def held_read(key, *args):  # the memory tier's load path: a chunk at a time, verified, copied once
            if "step-000000000001/" in key and key.endswith("rank-00000/part-000000"):  # hold one read (one worker slot)
                reading.set()
                await release.wait()
            return await real_read(key, *args)

        monkeypatch.setattr(host, "read_chunks", held_read)
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


@pytest.mark.parametrize("read", ["load", "export"])
async def test_retention_spares_a_checkpoint_a_load_is_still_picking(make_config, monkeypatch, tmp_path, read):
    """The load (and the export) marked its step busy only after the pick; a retention pass between the two
    removed the step under it (`IntegrityError`: no tier returned it intact). Now no pass removes anything
    while a read picks, and the read holds its step before the pick ends."""
    from tiered_ckpt.load.catalog import Catalog

    real_pick, picked, go_on = Catalog.pick, asyncio.Event(), asyncio.Event()

    async def held_pick(self, *args, **kwargs):
        status = await real_pick(self, *args, **kwargs)
        if status.step == 1:
            picked.set()
            await go_on.wait()
        return status

    monkeypatch.setattr(Catalog, "pick", held_pick)
    async with tc.Engine(make_config(tiers=[{"keep_last": 1}, {"keep_last": 1}])) as engine:
        await (await engine.save(1, state_of(1.0))).wait()
        if read == "load":
            loading = asyncio.create_task(load_values(engine, step=1))
        else:
            loading = asyncio.create_task(exported(engine, tmp_path / "step1.pt", step=1))
        await picked.wait()
        saving = await engine.save(2, state_of(2.0))  # its retention pass, once committed, would retire step 1
        while not any(s.step == 2 and s.complete == {"host", "disk"} for s in await engine.statuses()):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # (the old code's pass removed step 1 here)
        go_on.set()
        info, out = await loading
        await saving.wait()  # (its retention waited for the pick)
        assert info.step == 1 and torch.all(out["w"] == 1.0)
        await (await engine.save(3, state_of(3.0))).wait()
        assert [c.step async for c in engine.list()] == [3]  # the passes deferred take it once the load is done


async def exported(engine, path, step):
    """Export `step` as a torch file; (its ExportInfo, what the file holds)."""
    info = await engine.export(path, to="torch", step=step)
    return info, torch.load(path)


async def test_a_tier_that_cannot_keep_up_skips_to_the_newest_and_retention_holds_during_a_burst(make_config):
    """30 saves in a row with keep_last = 2 and a disk far slower than the saves: the disk skips saves that
    a newer one superseded while they waited (reported in the handle and in list()), jobs in flight stay
    bounded, and the disk never holds more than keep_last complete checkpoints plus those committing."""
    config = make_config(tiers=[{"keep_last": 2}, {"kind": "faulty", "keep_last": 2}])
    async with tc.Engine(config) as engine:
        disk = faults(config)
        disk.inject("stall")  # a disk that cannot keep up: it writes nothing until the burst is over (the writer's
        # probe of the tier at the first save goes through: it is no "write")
        handles, most_jobs, most_on_disk = [], 0, 0
        for step in range(1, 31):
            handles.append(await asyncio.wait_for(engine.save(step, state_of(float(step))), 30))
            most_jobs = max(most_jobs, engine.saves_in_flight)
            most_on_disk = max(most_on_disk, sum("disk" in c.complete for c in await engine.statuses()))
            if step == 20:
                disk.clear()  # the last ten saves find the disk writing again
        for h in handles:
            await h.wait()  # skipping is not an error
        skipped = {h.step: h.skipped["disk"] for h in handles if "disk" in h.skipped}
        assert skipped and all(newer > step for step, newer in skipped.items()), skipped
        assert not any(h.skipped.get("host") for h in handles[-1:]) and handles[-1].skipped == {}
        assert most_jobs <= engine.config.engine.max_inflight + 2 * 2, most_jobs
        # keep_last, and saves still in flight (a save complete on disk whose retention pass has not run yet is one
        # of them): a bound that holds however slow the machine is (it was 14 before saves took turns)
        assert most_on_disk <= 2 + engine.config.engine.max_inflight + 2 * 2, most_on_disk
        listing = [c async for c in engine.list()]
        assert [c.step for c in listing if "disk" in c.complete] == [29, 30] or \
            [c.step for c in listing if "disk" in c.complete][-1] == 30
        assert all(c.skipped["disk"] > c.step for c in listing if "disk" in c.tiers and "disk" not in c.complete)
        _, out = await load_values(engine, tiers=["disk"])
        assert torch.all(out["w"] == 30.0)
        # once the burst is over, no tier holds more than keep_last (passes that spared busy steps came back)
        statuses = await engine.statuses()
        assert all(sum(t in c.complete for c in statuses) <= 2 for t in ("host", "disk")), statuses


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


async def test_retention_never_removes_another_runs_write_in_progress(tmp_path, make_config):
    """Another run (another index) is writing step 1 under the same memory-tier path and job: its temp file,
    which listings do not show, survives this run's retention of its own step 1."""
    other = make_config(index=f"file://{tmp_path}/other-index")
    async with tc.Engine(other) as engine:
        theirs = engine.store.io.driver("host").path_of(f"test/{step_dir(1)}/{engine.incarnation}/rank-00000/.tmp-part-000000.x")
    theirs.parent.mkdir(parents=True)
    theirs.write_bytes(b"half a part")
    async with tc.Engine(make_config(tiers=[{"keep_last": 1}])) as engine:
        for step in (1, 2):
            await (await engine.save(step, state_of(float(step)))).wait()
        assert [c.step for c in await engine.statuses() if "host" in c.complete] == [2]
    assert theirs.read_bytes() == b"half a part"


async def test_delete_removes_index_entry_and_tier_data(engine):
    for step in (1, 2):
        await (await engine.save(step, state_of(float(step)))).wait()
    await engine.delete(2)
    assert [c.step async for c in engine.list()] == [1]
    assert not [k for k in await engine.store.io.driver("disk").list("test/") if "step-000000000002" in k]
    with pytest.raises(tc.IncompleteCheckpoint):
        await engine.delete(2)


async def test_a_deletion_cut_short_never_brings_the_checkpoint_back_and_is_finished(make_config, shm_dir):
    """A crash inside delete(1): the tombstone and the index removal happened, the data did not. The tiers'
    manifests must not resurrect step 1, and the next writer removes its data."""
    config = make_config()
    async with tc.Engine(config) as engine:
        await (await engine.save(1, state_of(1.0))).wait()
        await engine.store.index.bury(engine.job, 1)  # what delete() does first...
        await engine.store.index.delete(engine.job, 1)  # ...and second; then the process dies
    leftovers = lambda: sorted(p.name for p in (shm_dir / "host" / "test").iterdir())  # noqa: E731
    assert leftovers() == ["step-000000000001"]
    async with tc.Engine(config) as engine:
        with pytest.raises(tc.IncompleteCheckpoint):
            await load_values(engine)  # the manifests on the tiers are not taken: step 1 is buried
        await (await engine.save(2, state_of(2.0))).wait()  # the writer finishes the removal
        assert leftovers() == ["step-000000000002"] and await engine.store.index.buried(engine.job) == set()
        assert [c.step async for c in engine.list()] == [2]


@pytest.mark.parametrize("lands", ["after the record is read", "between the temp file and the rename"])
async def test_a_removal_landing_inside_unmark_neither_fails_nor_brings_the_step_back(tmp_path, monkeypatch, lands):
    """Retention drops a tier of step 3 (`unmark` rewrites its `begun` record by temp file and rename) while a
    removal of step 3 (`delete`, or retention on its last tier) removes its folder. Seen in Lightning DDP runs as
    `FileNotFoundError: .../.tmp-begun... -> .../begun` in retention's log; the other order re-created the folder,
    and the removed step was listed again, incomplete."""
    import shutil

    from tiered_ckpt.storage.index import file as file_index

    index = file_index.FileIndex(tmp_path / "index")
    await index.open()
    await index.begin("j", 3, ["host", "disk"])
    for tier in ("host", "disk"):
        assert await index.mark_durable("j", 3, tier, 0, 1, "s")
    folder = tmp_path / "index" / "j" / step_dir(3)
    if lands == "after the record is read":
        real_read = file_index._read_begun

        def read_then_removed(path):
            record = real_read(path)
            shutil.rmtree(folder)
            return record

        monkeypatch.setattr(file_index, "_read_begun", read_then_removed)
    else:
        real_replace = os.replace

        def removed_then_replace(src, dst):
            if os.path.basename(dst) == "begun" and folder.exists():
                shutil.rmtree(folder)
            return real_replace(src, dst)

        monkeypatch.setattr(os, "replace", removed_then_replace)
    await index.unmark("j", 3, "host")
    monkeypatch.undo()
    assert not folder.exists() and await index.list("j") == []


# -- rules beside keep_last: keep_best (by a metric of save()'s metadata) and keep_every ---------------------------
LOSSES = {1: 5.0, 2: 1.0, 3: 4.0, 4: 3.0, 5: 0.5, 6: 6.0, 7: None, 8: 7.0, 9: 2.0}  # 7: saved without the metric


def held_steps(root) -> list[int]:
    return sorted(int(p.name.removeprefix("step-")) for p in (root / "test").iterdir() if p.name.startswith("step-"))


@pytest.mark.parametrize("mode, best", [("min", [2, 5]), ("max", [6, 8])])
async def test_keep_best_and_keep_every_beside_keep_last(make_config, tmp_path, mode, best):
    """keep_last = 2, keep_best = 2 by val_loss, keep_every = 4 on the disk: the newest two, the two best (a
    checkpoint without the metric, or with a string there, is judged by keep_last alone) and every fourth step
    stay; everything else goes as the saves go on. The memory tier, with keep_last alone, keeps its newest two."""
    rules = {"keep_last": 2, "keep_best": 2, "best_metric": "val_loss", "best_mode": mode, "keep_every": 4}
    async with tc.Engine(make_config(tiers=[{"keep_last": 2}, rules])) as engine:
        for step, loss in LOSSES.items():
            metadata = {"val_loss": loss} if loss is not None else {"val_loss": "n/a"}
            await (await engine.save(step, state_of(float(step)), metadata=metadata)).wait()
        expected = sorted({8, 9} | set(best) | {4, 8})
        assert [c.step for c in await engine.statuses() if "disk" in c.complete] == expected
        assert held_steps(tmp_path / "disk") == expected  # the data too, not only the index
        assert [c.step for c in await engine.statuses() if "host" in c.complete] == [8, 9]


async def test_a_full_tier_retires_what_only_keep_last_keeps_before_the_best(make_config):
    """A disk with room for three 10 MiB states, keep_last = 2 and keep_best = 1: step 1 is the best. Each save
    from step 4 on meets a full disk; the checkpoint retired to make room used to be the oldest, the best one.
    Now it is the older of the keep_last pair, and the best stays for load(best=True)."""
    big = lambda v: {"w": torch.full((10 * 2**18,), v)}  # noqa: E731  (10 MiB)
    disk = {"keep_last": 2, "keep_best": 1, "best_metric": "val_loss", "capacity": "35MiB"}
    async with tc.Engine(make_config(tiers=[{}, disk])) as engine:
        for step in range(1, 7):
            await (await engine.save(step, big(float(step)), metadata={"val_loss": 0.1 if step == 1 else step})).wait()
        assert [c.step for c in await engine.statuses() if "disk" in c.complete] == [1, 5, 6]
        out = big(0.0)
        info = await engine.load(out, best=True, tiers=["disk"])
        assert info.step == 1 and torch.all(out["w"] == 1.0)


async def test_a_best_checkpoint_the_index_forgot_stays_on_the_tier(make_config, tmp_path, shm_dir):
    """The index loses step 1's record under a live writer (a Redis restored from an older snapshot): the
    tier's own listing shows a whole step 1 that no record leads to. Retention used to remove it as older than
    keep_last; its manifest's metadata says it is the best, so the disk keeps it, and the memory tier (keep_last
    alone) lets it go. Until the next writer lists step 1 again, the index's own best (step 2) stays too: a pass
    judges what the index lists by the index alone, so it errs on keeping one more."""
    disk = {"keep_last": 2, "keep_best": 1, "best_metric": "val_loss"}
    config = make_config(tiers=[{"keep_last": 2}, disk])
    async with tc.Engine(config) as engine:
        for step in (1, 2, 3):
            await (await engine.save(step, state_of(float(step)), metadata={"val_loss": float(step)})).wait()
        await engine.store.index.delete(engine.job, 1)  # forgotten; its folders stay on the tiers
        for step in (4, 5):
            await (await engine.save(step, state_of(float(step)), metadata={"val_loss": float(step)})).wait()
        assert held_steps(tmp_path / "disk") == [1, 2, 4, 5]
        assert held_steps(shm_dir / "host") == [4, 5]
        info, out = await load_values(engine, step=1)
        assert info.step == 1 and torch.all(out["w"] == 1.0)
    async with tc.Engine(config) as engine:  # the next writer lists step 1 again, with its metadata
        await (await engine.save(6, state_of(6.0), metadata={"val_loss": 6.0})).wait()
        assert held_steps(tmp_path / "disk") == [1, 5, 6] and (await engine.best()).step == 1


async def test_load_best_picks_the_best_complete_checkpoint(make_config):
    """load(best=True) on the Engine and the Checkpointer, Engine.best and the guards: best with step, and no
    metric configured."""
    disk = {"keep_last": 1, "keep_best": 2, "best_metric": "acc", "best_mode": "max"}
    config = make_config(tiers=[{"keep_last": 1}, disk])
    async with tc.Engine(config) as engine:
        with pytest.raises(tc.IncompleteCheckpoint, match="'acc'"):
            await engine.best()  # nothing saved yet
        for step, acc in ((1, 0.5), (2, 0.9), (3, float("nan")), (4, 0.7)):
            await (await engine.save(step, state_of(float(step)), metadata={"acc": acc})).wait()
        assert (await engine.best()).step == 2 and (await engine.best(tiers=["host"])).step == 4  # host: only 4
        assert (await engine.load(state_of(-1.0), best=True)).step == 2
        with pytest.raises(ValueError, match="not both"):
            await engine.load(state_of(-1.0), best=True, step=4)
    with tc.Checkpointer(config) as ckpt:
        out = state_of(-1.0)
        assert ckpt.load(out, best=True).step == 2 and torch.all(out["w"] == 2.0) and ckpt.best().step == 2
    async with tc.Engine(make_config()) as engine:
        with pytest.raises(tc.ConfigError, match="best_metric"):
            await engine.load(state_of(-1.0), best=True)


async def test_a_tier_renamed_in_the_config_keeps_its_copies(make_config, tmp_path, caplog):
    """The disk tier renamed (same path): the index's records name the old tier. Retention of the first save
    through the new config, and gc, used to remove every earlier copy there as one "this checkpoint left"."""
    async with tc.Engine(make_config(tiers=[{}, {"keep_last": 3}])) as engine:
        for step in (1, 2):
            await (await engine.save(step, state_of(float(step)))).wait()
    folder = tmp_path / "disk" / "test"
    before = sorted(p.name for p in folder.iterdir())
    async with tc.Engine(make_config(tiers=[{}, {"name": "ssd", "keep_last": 3}])) as engine:
        await (await engine.save(3, state_of(3.0))).wait()
        report = await engine.gc()
    assert "the index lists checkpoints on tier(s) disk, which this config does not have" in caplog.text
    assert sorted(p.name for p in folder.iterdir()) == sorted([*before, step_dir(3)])
    assert [line for line in report.kept if "names tier(s) disk" in line] and not report.removed
    async with tc.Engine(make_config(tiers=[{}, {"keep_last": 3}])) as engine:  # the earlier name again
        for step in (1, 2):
            info, out = await load_values(engine, step=step, tiers=["disk"])
            assert info.step == step and torch.all(out["w"] == float(step))


async def test_a_full_tier_makes_room_from_the_copies_a_renamed_tier_left(make_config, tmp_path):
    """Retention leaves a renamed tier's copies alone, but a tier full of them would fail every save: making room
    retires them (this config cannot load them anyway) before a save fails with TierFull."""
    big = lambda v: {"w": torch.full((10 * 2**18,), v)}  # noqa: E731  (10 MiB)
    before = {"capacity": "35MiB", "keep_last": 3}
    async with tc.Engine(make_config(tiers=[{}, before])) as engine:
        for step in (1, 2, 3):
            await (await engine.save(step, big(float(step)))).wait()
    renamed = {**before, "name": "ssd", "keep_last": 1}
    async with tc.Engine(make_config(tiers=[{}, renamed])) as engine:
        handle = await engine.save(4, big(4.0))
        await handle.wait()
        assert "ssd" in (await engine.status(4)).complete
    left = sorted(p.name for p in (tmp_path / "disk" / "test").iterdir())
    assert step_dir(4) in left and len(left) <= 3, left  # room was made from steps 1-3


@pytest.mark.parametrize("index", ["file", "redis"])
async def test_two_processes_retiring_a_steps_two_tiers_at_once_leave_no_record_behind(make_config, tmp_path, shm_dir,
                                                                                      redis_server, index):
    """The trainer retires step 1 from its memory tier while the node agent of a gone trainer retires it from the
    disk: each read the step on both tiers, so neither removal was its last. Before: the record stayed, on no
    tier (listed, incomplete, for good). Now whoever finds it on no tier after its removal takes it out, leaving
    it buried until the next writer finishes the burial. (The file index also lost one of the two unmarks: each
    rewrote the step's record without its own tier; it now locks the step's folder for that.)"""
    config = make_config(**({"index": redis_server().url} if index == "redis" else {}))
    async with tc.Engine(config) as engine:
        await _retire_both_tiers_at_once(engine, tmp_path, shm_dir)


async def _retire_both_tiers_at_once(engine, tmp_path, shm_dir):
    from tiered_ckpt.lifecycle.busy import BusySteps
    from tiered_ckpt.lifecycle.removal import Removal

    for step in (1, 2):
        await (await engine.save(step, state_of(float(step)))).wait()
    await engine.wait_all()
    status = await engine.store.status(1)
    assert set(status.tiers) == {"host", "disk"}
    agent = Removal(engine.job, engine.store.index, engine.store.io, BusySteps(), set())  # the other process's
    await asyncio.gather(engine.store.removal.drop_tier(status, "host"), agent.drop_tier(status, "disk"))
    assert [c.step async for c in engine.list()] == [2]
    assert await engine.store.index.steps(engine.job) == [2]  # no record left behind, listed or not
    assert await engine.store.index.buried(engine.job) == {1}
    assert held_steps(tmp_path / "disk") == held_steps(shm_dir / "host") == [2]
    await engine.store.removal.finish_burials()  # what the next writer's start does
    assert await engine.store.index.buried(engine.job) == set()
