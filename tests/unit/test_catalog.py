"""Which checkpoint a load takes: incomplete ones never, the memory tier after a restart, a lost or garbled
index record reported, and the tiers' manifests when the index is gone."""

import pytest
import torch

import tiered_ckpt as tc
from tiered_ckpt.layout import PartKey

from .common import load_values, state_of


async def test_incomplete_checkpoint_is_listed_but_never_loaded(engine):
    await (await engine.save(1, state_of(1.0))).wait()
    await engine.store.index.begin("test", 2, ["host", "disk"])  # a save that never finished
    await engine.store.io.driver("host").write(PartKey("test", 2, 0, 0).path, memoryview(b"junk"))
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


async def test_load_with_nothing_saved_is_a_clear_error(engine):
    with pytest.raises(tc.IncompleteCheckpoint, match="no complete checkpoint"):
        await load_values(engine)


async def test_restarted_process_loads_from_memory_tier(make_config):
    cfg = make_config()
    async with tc.Engine(cfg) as engine:
        await (await engine.save(1, state_of(1.0))).wait()
    async with tc.Engine(cfg) as engine:  # a new engine: nothing cached in this process
        info, out = await load_values(engine)
        assert info.tier == "host" and torch.all(out["w"] == 1.0)
        with pytest.raises(tc.CheckpointExists):
            await engine.save(1, state_of(1.0))


async def test_a_lost_or_garbled_newest_record_never_hides_the_newest_committed_checkpoint(engine, tmp_path, caplog):
    """The index loses step 3's record and garbles step 2's: both are still whole and committed on the tiers,
    so a load without step= takes step 3 (saying why), an explicit step 2 loads too, and the garbled record is
    reported, listed as incomplete."""
    import logging

    for step in (1, 2, 3):
        await (await engine.save(step, state_of(float(step)))).wait()
    await engine.store.index.delete(engine.job, 3)  # the newest record lost
    (tmp_path / "index" / "test" / "step-000000000002" / "begun").write_bytes(b"\x00garbage")  # one garbled
    caplog.set_level(logging.WARNING)
    info, out = await load_values(engine)
    assert info.step == 3 and torch.all(out["w"] == 3.0)
    assert "step 3 is whole on" in caplog.text and "does not list it" in caplog.text
    assert "step 2" in caplog.text and "cannot be read" in caplog.text  # the garbled record, named
    status = {c.step: c for c in [c async for c in engine.list()]}
    assert "index" in status[2].failed and not status[2].is_complete
    info, out = await load_values(engine, step=2)  # an explicit step: from the tiers' manifests
    assert info.step == 2 and torch.all(out["w"] == 2.0)


async def test_an_index_lost_between_two_runs_loses_no_checkpoint(tmp_path, make_config):
    """The file index is removed between two runs: the next run's load finds the newest committed checkpoint
    on the tiers, its first save lists the forgotten ones in the index again, and they stay refused as steps
    to save over."""
    import shutil

    config = make_config()
    async with tc.Engine(config) as engine:
        for step in (1, 2):
            await (await engine.save(step, state_of(float(step)))).wait()
    shutil.rmtree(tmp_path / "index")
    async with tc.Engine(config) as engine:
        info, out = await load_values(engine)
        assert info.step == 2 and torch.all(out["w"] == 2.0)
        await (await engine.save(3, state_of(3.0))).wait()
        assert [(c.step, sorted(c.complete)) async for c in engine.list()] == [
            (1, ["disk", "host"]), (2, ["disk", "host"]), (3, ["disk", "host"])]
        with pytest.raises(tc.CheckpointExists):
            await (await engine.save(1, state_of(9.0))).wait()
        info, out = await load_values(engine, step=1)
        assert torch.all(out["w"] == 1.0)


async def test_a_copy_missing_a_ranks_record_is_whole_nowhere(engine):
    """"Is this copy whole?" has one answer for the catalog, loads and gc: a tier whose copy lacks a rank's
    checksum record (written only once that rank's parts are durable) does not hold the checkpoint whole. With
    the index's record lost, the tiers' listing names only the tier whose copy is whole, a load reads from it,
    and gc removes the partial copy while it keeps the whole one."""
    from pathlib import Path

    from tiered_ckpt.layout import rank_meta_key, step_dir

    for step in (1, 2):
        await (await engine.save(step, state_of(float(step)))).wait()
    await engine.store.index.delete(engine.job, 2)  # the record lost: the tiers are all there is
    host = engine.store.io.driver("host")
    Path(host.path_of(rank_meta_key(engine.job, 2, 0, engine.incarnation))).unlink()
    [status] = [s for s in await engine.store.catalog.statuses_from_tiers() if s.step == 2]
    assert status.complete == frozenset({"disk"}) and set(status.tiers) == {"host", "disk"}
    info, out = await load_values(engine, step=2)
    assert info.tier == "disk" and torch.all(out["w"] == 2.0)
    report = await engine.gc()
    assert any(line.startswith("step 2 on disk: a whole checkpoint") for line in report.kept), report.kept
    assert not [k for k in await host.list(f"{engine.job}/") if step_dir(2) in k]
    assert [k for k in await engine.store.io.driver("disk").list(f"{engine.job}/") if step_dir(2) in k]
