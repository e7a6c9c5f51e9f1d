"""The commit of a save on a tier: a failed tier loses nothing committed, gives its room back, and a commit
whose reply was lost keeps its parts; skips are recorded as data every rank reads."""

import pytest
import torch

import tiered_ckpt as tc

from .common import load_values, state_of


async def test_a_failed_tier_leaves_earlier_checkpoints_intact(make_config):
    cfg = make_config(tiers=[{"capacity": "300KiB"}], stage_in_memory_tier=False)  # parts written, not staged there
    async with tc.Engine(cfg) as engine:
        await (await engine.save(1, state_of(1.0))).wait()  # ~200 KiB: fits
        handle = await engine.save(2, state_of(2.0))  # does not fit next to step 1 on host
        await handle.wait()  # complete on disk: a checkpoint, no error
        assert set(handle.errors) == {"host"} and isinstance(handle.errors["host"], tc.TierFull)
        with pytest.raises(tc.TierFull):
            await handle.wait("host")
        await handle.wait("disk")  # the disk tier still completed
        listing = {c.step: c for c in [c async for c in engine.list()]}
        assert listing[2].complete == {"disk"} and "host" in listing[2].failed
        _, out = await load_values(engine, step=1, tiers=["host"])
        assert torch.all(out["w"] == 1.0)
        info, out = await load_values(engine)
        assert info.step == 2 and info.tier == "disk" and torch.all(out["w"] == 2.0)


async def test_a_save_that_fails_on_a_full_tier_gives_its_room_back(make_config, shm_dir):
    """The memory tier fills up part-way through save 1 (capacity): the parts it did write are removed, so
    save 2, which fits, succeeds there; without that, every later save to the tier would fail too."""
    async with tc.Engine(make_config(tiers=[{"capacity": "300KiB", "required": True}],
                                     stage_in_memory_tier=False)) as engine:
        big = {"w": torch.ones(100_000)}  # 400 KB: does not fit
        with pytest.raises(tc.SaveError, match=r"host.*TierFull"):  # required: its failure fails the save
            await (await engine.save(1, big)).wait()
        assert sum(f.stat().st_size for f in (shm_dir / "host").rglob("*") if f.is_file()) == 0
        await (await engine.save(2, {"w": torch.ones(50_000)})).wait()  # 200 KB
        assert (await engine.status(2)).complete == {"host", "disk"}


async def test_a_commit_whose_reply_was_lost_keeps_its_parts(make_config, monkeypatch):
    """The index runs the commit, then the connection fails before the reply (IndexUnavailable): the save
    fails on that tier, but the tier may be complete in the index, so its parts must stay and load."""
    from tiered_ckpt.errors import IndexUnavailable

    async with tc.Engine(make_config(stage_in_memory_tier=False)) as engine:
        real = engine.store.index.mark_durable

        async def reply_lost(job, step, tier, *args):
            await real(job, step, tier, *args)
            if tier == "disk":
                raise IndexUnavailable("connection reset after the commit ran")
            return True

        monkeypatch.setattr(engine.store.index, "mark_durable", reply_lost)
        handle = await engine.save(1, state_of(1.0))
        with pytest.raises(IndexUnavailable):
            await handle.wait("disk")
        assert [sorted(c.complete) for c in await engine.statuses()] == [["disk", "host"]]
        _, out = await load_values(engine, tiers=["disk"])
        assert torch.all(out["w"] == 1.0)


async def test_a_skip_is_recorded_as_data_that_every_rank_reads(tmp_path):
    """A rank that skips a tier records the newer step; another rank of the session waiting for the commit
    takes it as a skip (Superseded with that step), never as a failure; list() reports it apart from failures."""
    from tiered_ckpt.save.commit import Committer, Superseded
    from tiered_ckpt.storage.index.file import FileIndex

    index = FileIndex(tmp_path / "index")
    await index.open()
    one, two = (Committer(index, "job", rank=r, world_size=2, session="s1", timeout=30) for r in (0, 1))
    await one.begin(4, ["host", "disk"], nbytes=10, metadata={})
    await one.skip_tier(4, "disk", 6)
    assert await two.skipped(4, "disk") == 6 and await two.skipped(4, "host") is None
    with pytest.raises(Superseded) as err:
        await two.wait_complete(4, "disk")
    assert err.value.newer == 6
    await one.fail_tier(4, "host", tc.TierFull("no space", tier="host"))
    with pytest.raises(tc.RankFailed, match="rank 0: TierFull") as failed:
        await two.wait_complete(4, "host")
    assert not isinstance(failed.value, tc.TierError) and failed.value.tier == "host"
    [status] = await index.list("job")
    assert status.skipped == {"disk": 6} and set(status.failed) == {"host"} and status.settled == {"disk", "host"}
    await index.close()


async def test_an_index_whose_tier_state_takes_no_rank_is_polled_as_before(tmp_path):
    """An index of a third party (or an earlier release) whose tier_state has no `rank` keyword: two ranks still
    commit through it, each marker counted once."""
    from tiered_ckpt.save.commit import Committer
    from tiered_ckpt.storage.index.file import FileIndex

    class Plain(FileIndex):
        async def tier_state(self, job, step, tier, session):
            return await super().tier_state(job, step, tier, session)

    index = Plain(tmp_path / "index")
    await index.open()
    one, two = (Committer(index, "job", rank=r, world_size=2, session="s1", timeout=30) for r in (0, 1))
    await one.begin(4, ["disk"], nbytes=10, metadata={})
    for committer in (one, two):
        await committer.mark_durable(4, "disk")
    await one.wait_complete(4, "disk")
    await two.wait_complete(4, "disk")
    [status] = await index.list("job")
    assert status.complete == {"disk"}
    await index.close()


async def test_writer_errors_are_typed(make_config):
    """A second writer of a job meets WriterConflict (a BlockingIOError too); it is not saved over."""
    async with tc.Engine(make_config()) as first:
        await (await first.save(1, state_of(1.0))).wait()
        async with tc.Engine(make_config()) as second:
            with pytest.raises(tc.WriterConflict, match="already has a writer") as err:
                await second.save(2, state_of(2.0))
            assert isinstance(err.value, BlockingIOError) and not second.is_writer
    assert issubclass(tc.Fenced, PermissionError) and issubclass(tc.AuthenticationError, PermissionError)
