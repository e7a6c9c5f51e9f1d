"""Mistakes caught when the engine opens (or, for an engine that is a reader until its first save, at that
save's call), in one line naming the problem, instead of in the background of a save: a second trainer of the
job, a tier path that can never be written, a reader asked to save."""
import pytest
import torch

import tiered_ckpt as tc


def state(value: float) -> dict:
    return {"w": torch.full((10_000,), value)}


async def test_a_second_writer_fails_at_open_naming_the_first(make_config):
    async with tc.Engine(make_config(role="writer")) as first:
        assert first.is_writer  # it took the lease at open, before any save
        with pytest.raises(tc.WriterConflict) as conflict:
            await tc.Engine(make_config(role="writer")).open()
        message = str(conflict.value)
        assert "already has a writer" in message and "pid" in message and "\n" not in message
        await (await first.save(1, state(1.0))).wait()  # the first trainer is untouched
    async with tc.Engine(make_config(role="writer")) as after:  # once it is gone, the next one opens
        assert [s.step for s in await after.statuses()] == [1]


async def test_a_second_trainer_learns_of_the_writer_before_being_told_to_delete_its_steps(make_config):
    """Steps 1 and 2 exist, saved by a trainer that still runs: the second one's save(1) says WriterConflict,
    never "CheckpointExists ... delete it to save it again" (following that would delete the live run's work)."""
    async with tc.Engine(make_config()) as first:
        for step in (1, 2):
            await (await first.save(step, state(step))).wait()
        async with tc.Engine(make_config()) as second:
            for step in (1, 2, 3):
                with pytest.raises(tc.WriterConflict):
                    await second.save(step, state(step))
        assert [s.step for s in await first.statuses()] == [1, 2]


async def test_a_tier_that_can_never_be_written_fails_at_open_or_at_the_first_save_call(make_config):
    bad = {"path": "/proc/tiered_ckpt-cannot-be-here"}  # /proc takes no folders, for root either
    with pytest.raises(tc.TierError) as at_open:
        await tc.Engine(make_config(tiers=[{}, bad], role="writer")).open()
    assert "tier 'disk'" in str(at_open.value) and "/proc/tiered_ckpt-cannot-be-here" in str(at_open.value)
    async with tc.Engine(make_config(tiers=[{}, bad])) as engine:  # a reader until its first save
        with pytest.raises(tc.TierError) as at_save:
            await engine.save(1, state(1.0))  # raised by the call itself, not logged by a background save
        assert "tier 'disk'" in str(at_save.value)
        assert await engine.statuses() == []  # nothing half-begun in the index


async def test_a_reader_never_saves_nor_takes_the_lease(make_config):
    async with tc.Engine(make_config(role="writer")) as trainer:
        await (await trainer.save(1, state(1.0))).wait()
        async with tc.Engine(make_config(role="reader")) as evaluator:  # beside the trainer: no conflict
            out = state(0.0)
            assert (await evaluator.load(out)).step == 1 and bool((out["w"] == 1.0).all())
            with pytest.raises(tc.ConfigError) as refused:
                await evaluator.save(2, state(2.0))
            assert "engine.role" in str(refused.value)
            with pytest.raises(tc.ConfigError, match="never deletes") as refused:  # it took the lease before
                await evaluator.delete(1)
            assert "engine.role" in str(refused.value)
        await (await trainer.save(2, state(2.0))).wait()
        assert [s.step for s in await trainer.statuses()] == [1, 2]  # step 1 is still there


def test_an_unknown_role_is_refused_naming_the_key(make_config):
    with pytest.raises(tc.ConfigError) as bad:
        make_config(role="boss")
    assert "engine.role" in str(bad.value) and "writer" in str(bad.value)
