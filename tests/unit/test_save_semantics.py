"""What a training loop relies on: mutation after save, lazy staging, the plan cache without stale data, a
step saved twice, errors that are never lost."""

import asyncio

import pytest
import torch

import tiered_ckpt as tc

from .common import load_values, state_of


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


async def test_a_reopened_engine_refuses_saved_steps_without_listing_the_history(make_config, monkeypatch):
    """The open reads only the index's newest step (one call, whatever the history a job keeps): a step up to it
    is looked up alone when saved (refused when complete, allowed once deleted), and a newer step asks nothing."""
    from tiered_ckpt.storage.index.file import FileIndex

    config = make_config()
    async with tc.Engine(config) as e:
        for step in (1, 2, 3):
            await (await e.save(step, state_of(float(step)))).wait()
        await e.delete(2)
    listed: list[str] = []
    whole_listing = FileIndex.list

    async def counting_list(self, job):
        listed.append(job)
        return await whole_listing(self, job)

    monkeypatch.setattr(FileIndex, "list", counting_list)
    async with tc.Engine(config) as e:
        for step in (3, 1):
            with pytest.raises(tc.CheckpointExists, match=f"step {step} already exists"):
                await e.save(step, state_of(9.0))
        await (await e.save(2, state_of(2.5))).wait()  # deleted: saved again
        await (await e.save(4, state_of(4.0))).wait()
        await e.wait_all()  # done on every tier, not merely in flight
        with pytest.raises(tc.CheckpointExists, match="step 4 already exists"):
            await e.save(4, state_of(9.0))
        assert listed == []  # neither the open nor a save listed the job's checkpoints
        for step, value in ((1, 1.0), (2, 2.5), (3, 3.0), (4, 4.0)):
            _, out = await load_values(e, step=step)
            assert torch.all(out["w"] == value), step


async def test_unobserved_background_error_is_raised_at_close(make_config):
    """The run's last save committed on no tier, and nobody waited on it: close() says so."""
    engine = await tc.Engine(make_config(tiers=[{"capacity": "100KiB"}, {"capacity": "100KiB"}],
                                         stage_in_memory_tier=False)).open()
    await engine.save(1, state_of(1.0))
    with pytest.raises(tc.SaveError, match="host.*the last save of the run committed on no tier"):
        await engine.close()


async def test_a_tier_failing_while_another_commits_is_no_error(make_config):
    """host fills up, disk commits: the checkpoint exists, so neither wait(), the next save nor close() raises;
    the handle still names the failed tier, and a load takes the checkpoint from disk."""
    engine = await tc.Engine(make_config(tiers=[{"capacity": "100KiB"}], stage_in_memory_tier=False)).open()
    handle = await engine.save(1, state_of(1.0))
    await handle.wait()
    assert set(handle.errors) == {"host"} and handle.committed_on == ("disk",)
    await (await engine.save(2, state_of(2.0))).wait()
    await engine.close()
    async with tc.Engine(make_config(stage_in_memory_tier=False)) as again:
        info, out = await load_values(again)
    assert info.step == 2 and info.tier == "disk" and torch.all(out["w"] == 2.0)


async def test_state_with_no_tensors_and_metadata(engine):
    await (await engine.save(5, {"epoch": 3, "note": "x"}, metadata={"git": "abc"})).wait()
    state = {"epoch": 0, "note": ""}
    await engine.load(state)
    assert state == {"epoch": 3, "note": "x"}
    manifest = await engine.read_manifest(5)
    assert manifest.metadata == {"git": "abc"}


async def test_arguments_of_the_wrong_type_are_named(engine):
    """Each used to give a misleading answer: "step 1 does not exist", unknown tiers ['d', 'i', 's', 'k'],
    a bare TypeError from dict()."""
    await (await engine.save(1, {"w": torch.ones(2)})).wait()
    with pytest.raises(TypeError, match=r"takes an int step, not str '1'"):
        await engine.load({"w": torch.zeros(2)}, step="1")
    with pytest.raises(TypeError, match=r"tiers=\['disk'\]"):
        await engine.load({"w": torch.zeros(2)}, tiers="disk")
    with pytest.raises(tc.StateError, match="metadata must be a dict"):
        await engine.save(2, {"w": torch.ones(2)}, metadata=[1])
    assert [c.step async for c in engine.list()] == [1]


async def test_a_background_failure_nobody_waited_for_is_raised_once_at_the_next_save(make_config):
    """Save 1 fails on the memory tier, marked required, in the background and nobody waits on its handle: save 2
    raises that error (naming step 1, the tier and the rule) and is not started; save 2 again goes ahead; close()
    raises nothing."""
    engine = await tc.Engine(make_config(tiers=[{"capacity": "100KiB", "required": True}, {}],
                                         stage_in_memory_tier=False)).open()
    try:
        await engine.save(1, state_of(1.0))
        await engine.wait_all()
        with pytest.raises(tc.SaveError, match=r"step 1 failed on 1 tier\(s\): host: TierFull.*required") as err:
            await engine.save(2, {"w": torch.ones(10)})
        assert err.value.step == 1 and set(err.value.errors) == {"host"}
        assert [c.step for c in await engine.statuses()] == [1]  # save 2 was not started
        await (await engine.save(2, {"w": torch.ones(10)})).wait()
    finally:
        await engine.close()  # the failure was raised once already: not again


async def test_training_stops_after_saves_in_a_row_that_committed_nowhere(make_config):
    """Every tier full: each save fails outright. The next save() goes on until stop_after_failed_saves saves in
    a row committed nowhere, then raises naming the rule; a save that commits resets the count."""
    full = {"capacity": "100KiB"}
    engine = await tc.Engine(make_config(tiers=[full, full], stage_in_memory_tier=False,
                                         stop_after_failed_saves=2)).open()
    try:
        await engine.save(1, state_of(1.0))
        await engine.wait_all()
        await (await engine.save(2, {"w": torch.ones(10)})).wait()  # one failed save: training goes on; this fits
        await engine.save(3, state_of(3.0))
        await engine.wait_all()
        await engine.save(4, state_of(4.0))  # 3 failed, 2 committed in between: still going
        await engine.wait_all()
        with pytest.raises(tc.SaveError, match=r"step 4 failed.*no tier committed the last 2 save\(s\)"):
            await engine.save(5, {"w": torch.ones(10)})
    finally:
        await engine.close()


@pytest.mark.parametrize("lazy", [False, True])
async def test_saves_called_at_once_start_one_at_a_time_in_call_order(make_config, lazy):
    """A fresh engine's first saves, called together (asyncio.gather, callbacks): each would become the job's
    writer, and the second used to take the writer lease beside the first and be refused as a second writer
    (naming this very process). They now start in call order; every one lands; a step given twice is refused."""
    async with tc.Engine(make_config(max_inflight=2, tiers=[{"keep_last": 8}, {"keep_last": 8}])) as engine:
        states = [state_of(float(step)) for step in range(1, 5)]
        handles = await asyncio.gather(*(engine.save(step, s, lazy=lazy) for step, s in enumerate(states, 1)))
        assert [h.step for h in handles] == [1, 2, 3, 4]
        for h in handles:
            await h.wait()
        listed = [s.step async for s in engine.list() if s.is_complete]
        assert listed == [1, 2, 3, 4]
        for step in range(1, 5):
            _, out = await load_values(engine, step=step)
            assert torch.all(out["w"] == step) and out["step"] == step
        twice = await asyncio.gather(engine.save(5, state_of(5.0), lazy=lazy), engine.save(5, state_of(6.0), lazy=lazy),
                                     return_exceptions=True)
        assert isinstance(twice[0], tc.SaveHandle) and isinstance(twice[1], tc.CheckpointExists)
        await twice[0].wait()
        _, out = await load_values(engine, step=5)
        assert torch.all(out["w"] == 5.0)


async def test_waiting_on_one_tier_does_not_silence_a_required_tiers_failure(make_config):
    """The loop waits for disk alone; host, marked required, fails: the next save() still stops training."""
    engine = await tc.Engine(make_config(tiers=[{"capacity": "100KiB", "required": True}, {}],
                                         stage_in_memory_tier=False)).open()
    try:
        handle = await engine.save(1, state_of(1.0))
        await handle.wait("disk")
        await engine.wait_all()
        with pytest.raises(tc.SaveError, match="required"):
            await engine.save(2, {"w": torch.ones(10)})
    finally:
        await engine.close()
