"""gc at a long history: a complete checkpoint's committed folder is the one its save recorded at begin, borne
out by the marker rank 0 leaves on each tier once the index committed it, so gc reads no manifest for it.
Without that record (an earlier release's save) or that marker, the index's manifest decides, as before."""
import pytest
import torch

import tiered_ckpt as tc
from tiered_ckpt.layout import PartKey, committed_key, incarnation_dir, new_session
from tiered_ckpt.storage.index.file import FileIndex


def state(value: float) -> dict:
    return {"w": torch.full((1000,), float(value))}


@pytest.fixture
def manifests_read(monkeypatch):
    """Manifests the file index has handed out (gc reads each complete checkpoint's on the old code)."""
    count = [0]
    real = FileIndex.get_manifest

    async def counted(self, job, step):
        count[0] += 1
        return await real(self, job, step)

    monkeypatch.setattr(FileIndex, "get_manifest", counted)
    return count


async def zombie_parts(engine: tc.Engine, step: int) -> str:
    """A fenced writer's folder of `step` beside the committed one, on both tiers: what gc must remove."""
    zombie = incarnation_dir(engine.store.index.identity, new_session())
    for tier in ("host", "disk"):
        await engine.store.io.driver(tier).write(PartKey("test", step, 0, 0, zombie).path, memoryview(bytes(100)))
    return zombie


async def test_gc_reads_no_manifest_of_a_complete_checkpoint_and_still_removes_a_zombies_folder(make_config,
                                                                                              manifests_read):
    """Failed on the old code: gc read the index's manifest of every complete checkpoint (10,000 reads, most of
    `gc --dry-run`'s 159 s at 10,000 checkpoints)."""
    async with tc.Engine(make_config(tiers=[{"keep_last": 20}, {"keep_last": 20}])) as engine:
        for step in range(1, 9):
            await (await engine.save(step, state(step))).wait()
        zombie = await zombie_parts(engine, 3)
        manifests_read[0] = 0
        report = await engine.gc()
        assert manifests_read[0] == 0
        assert {(r.tier, r.step) for r in report.removed} == {("host", 3), ("disk", 3)}
        assert all(zombie in r.name for r in report.removed)
        info = await engine.load(out := state(0.0), step=3)
        assert info.step == 3 and torch.all(out["w"] == 3.0)


async def test_without_the_committed_marker_gc_asks_the_manifest_and_keeps_the_committed_folder(make_config,
                                                                                             manifests_read):
    """The marker of the committed folder is missing on one tier (its write failed: it is best effort) and a
    later attempt's folder is there: gc may not take the recorded folder on trust; it reads the manifest and
    removes only the other folder."""
    async with tc.Engine(make_config(tiers=[{"keep_last": 20}, {"keep_last": 20}])) as engine:
        await (await engine.save(1, state(1.0))).wait()
        [status] = await engine.statuses()
        assert status.folder is not None  # recorded at begin
        await engine.store.io.driver("disk").delete(committed_key("test", 1, status.folder))
        zombie = await zombie_parts(engine, 1)
        manifests_read[0] = 0
        report = await engine.gc()
        assert manifests_read[0] == 1
        assert {r.tier for r in report.removed} == {"host", "disk"} and all(zombie in r.name for r in report.removed)
        info = await engine.load(out := state(0.0), step=1)
        assert info.step == 1 and torch.all(out["w"] == 1.0)


async def test_a_record_without_its_folder_is_judged_by_the_manifest(make_config, manifests_read):
    """A save of an earlier release recorded no folder at begin: gc reads its manifest, as before."""
    async with tc.Engine(make_config(tiers=[{"keep_last": 20}, {"keep_last": 20}])) as engine:
        await (await engine.save(1, state(1.0))).wait()
        index = engine.store.index
        await index.begin("test", 1, ["host", "disk"], {"nbytes": 4000, "metadata": {}})  # as an earlier release
        assert (await engine.statuses())[0].folder is None
        zombie = await zombie_parts(engine, 1)
        manifests_read[0] = 0
        report = await engine.gc()
        assert manifests_read[0] == 1
        assert {r.tier for r in report.removed} == {"host", "disk"} and all(zombie in r.name for r in report.removed)
