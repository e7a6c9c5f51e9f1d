"""Copies launched during the walk (save/early.py). On a GPU they are the large CUDA tensors' copies; CI has no GPU,
so these tests launch the host tensors' copies instead (`host_sources=True`): the same guesses, checks and
fallbacks, with each copy done at once rather than queued on a side stream."""
import asyncio
import threading
import time

import pytest
import torch

import tiered_ckpt as tc
from tiered_ckpt.save.copy import stage
from tiered_ckpt.save.early import EarlyCopies
from tiered_ckpt.save.plan import Planner
from tiered_ckpt.save.staging_buffer import StagingBuffer
from tiered_ckpt.state import flatten


class Recording(EarlyCopies):
    """Launches host copies, and keeps every launch it hands out."""

    def __init__(self):
        super().__init__(min_bytes=1, host_sources=True)
        self.launches = []

    def launch(self, known, buffer, events):
        launch = super().launch(known, buffer, events)
        self.launches.append(launch)
        return launch


def state(value: float, b_rows: int = 300) -> dict:
    return {"a": torch.arange(50_000, dtype=torch.float32) + value, "opt": {"step": int(value),
            "b": torch.full((b_rows, 10), value, dtype=torch.float64)}, "c": torch.tensor([value], dtype=torch.bfloat16)}


async def saved(engine, step: int, like: dict) -> dict:
    out = {"a": torch.zeros_like(like["a"]), "opt": {"step": 0, "b": torch.zeros_like(like["opt"]["b"])},
           "c": torch.zeros_like(like["c"])}
    assert (await engine.load(out, step=step, tiers=["host"])).step == step
    return out


def same(x: dict, y: dict) -> bool:
    return (torch.equal(x["a"], y["a"]) and torch.equal(x["opt"]["b"], y["opt"]["b"]) and torch.equal(x["c"], y["c"])
            and x["opt"]["step"] == y["opt"]["step"])


@pytest.mark.parametrize("reserved", [False, True])
async def test_the_next_save_of_a_plan_copies_during_the_walk(make_config, reserved):
    async with tc.Engine(make_config(max_inflight=1)) as engine:
        early = engine._saver.early = Recording()
        if reserved:  # reserve learns where the copies go: the first save launches already
            await engine.reserve(state(0.0))
        for step in (1, 2, 3):
            s = state(float(step))
            await engine.save(step, s)  # eager: the bytes are staged when it returns
            expected = {"a": s["a"].clone(), "opt": {"step": step, "b": s["opt"]["b"].clone()}, "c": s["c"].clone()}
            s["a"].add_(100.0)  # the caller's tensors change right after: the checkpoint keeps the old values
            s["opt"]["b"].zero_()
            await engine.wait_all()
            assert same(await saved(engine, step, s), expected), step
        launched = [len(launch.launched) for launch in early.launches]
        assert launched == ([3, 3, 3] if reserved else [3, 3]), launched  # every box (saves 2, 3; or all three)
        assert all(launch.ok for launch in early.launches)


async def test_a_changed_structure_drops_the_launch_and_saves_the_new_state(make_config):
    async with tc.Engine(make_config(max_inflight=1)) as engine:
        early = engine._saver.early = Recording()
        await (await engine.save(1, state(1.0))).wait()
        # 300 → 900 rows: a larger plan, so the launch's buffer cannot hold it; then a dtype change alone
        bigger = state(2.0, b_rows=900)
        await (await engine.save(2, bigger)).wait()
        assert early.launches[-1].ok is False  # "opt/b" no longer fits its place: the launch stopped there
        assert same(await saved(engine, 2, bigger), bigger)
        retyped = state(3.0, b_rows=900)
        retyped["a"] = retyped["a"].to(torch.int32)
        await (await engine.save(3, retyped)).wait()
        assert same(await saved(engine, 3, retyped), retyped)
        assert engine.pool.held == 0  # every dropped launch gave its buffer back
        await (await engine.save(4, retyped)).wait()  # and the next save of that plan launches again
        assert early.launches[-1].ok and len(early.launches[-1].launched) == 3


async def test_a_value_refused_mid_walk_keeps_the_last_checkpoint_and_the_buffer(make_config):
    async with tc.Engine(make_config(max_inflight=1)) as engine:
        early = engine._saver.early = Recording()
        await (await engine.save(1, state(1.0))).wait()
        bad = state(2.0)
        bad["z"] = object()  # walked last: the tensors before it were launched already
        with pytest.raises(tc.StateError, match="'z'"):
            await engine.save(2, bad)
        assert len(early.launches[-1].launched) == 3
        assert engine.pool.held == 0
        assert same(await saved(engine, 1, state(1.0)), state(1.0))
        await (await engine.save(2, state(2.0))).wait()
        assert same(await saved(engine, 2, state(2.0)), state(2.0))


async def test_stage_redoes_a_launch_made_for_another_plan():
    planner = Planner(part_size=1 << 20)
    old, new = state(1.0), state(2.0, b_rows=200)
    old_flat, new_flat = flatten(old), flatten(new)
    old_plan = await planner.plan(old_flat.paths, old_flat.tensors)
    new_plan = await planner.plan(new_flat.paths, new_flat.tensors)
    buf = StagingBuffer(max(old_plan.nbytes, new_plan.nbytes), pin=False)
    early = EarlyCopies(min_bytes=1, host_sources=True)
    early.learn(old_plan, [None] * len(old_plan.local), set())
    launch = early.launch(early.learned, buf, {})
    launch.start()
    flatten(old, on_tensor=launch.on_tensor, on_state_dict=launch.on_state_dict)
    assert len(launch.launched) == 3 and not launch.fits(new_plan, [None] * len(new_plan.local))
    stage(new_plan, new_flat.tensors, buf, launch=launch)
    for view, i in zip(buf.views_for(new_plan), new_plan.local.index):
        assert torch.equal(view, new_flat.tensors[i]), new_flat.paths[i]


def test_a_tensor_on_another_device_stops_the_launch():
    """The plan's key holds no device: a tensor that moved (here: expected on cuda:0, found on the host) ends
    the guess, and the staging thread decides from the sources it finds."""
    flat = flatten(state(1.0))
    import asyncio
    plan = asyncio.run(Planner(part_size=1 << 20).plan(flat.paths, flat.tensors))
    early = EarlyCopies(min_bytes=1)
    early.learn(plan, [torch.device("cuda", 0)] * len(plan.local), set())
    launch = early.launch(early.learned, StagingBuffer(plan.nbytes, pin=False), {})
    launch.on_tensor(0, flat.tensors[0])  # not started: no side stream is made, and none is needed to refuse
    assert not launch.ok and not launch.launched
    assert not launch.fits(plan, [None] * len(plan.local))


class Slow:
    """A stateful object whose state_dict() takes a while: the save is cancelled while the walk waits in it."""

    def __init__(self, started):
        self.started = started

    def state_dict(self):
        self.started.set()
        time.sleep(0.5)
        return {"b": torch.full((300, 10), 9.0, dtype=torch.float64)}

    def load_state_dict(self, state):
        pass


async def test_a_save_cancelled_mid_walk_launches_nothing_more_and_gives_its_buffer_back(make_config):
    async with tc.Engine(make_config(max_inflight=1)) as engine:
        early = engine._saver.early = Recording()
        started = threading.Event()
        state = {"a": torch.arange(50_000, dtype=torch.float32), "opt": Slow(started)}
        await (await engine.save(1, state)).wait()
        started.clear()
        saving = asyncio.create_task(engine.save(2, state))
        await asyncio.to_thread(started.wait, 10)
        assert early.launches[-1].launched == {0}  # "a" was launched before the walk reached "opt"
        saving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await saving
        await asyncio.sleep(1.0)  # the walk's thread went on meanwhile, and reached "opt/b"
        launch = early.launches[-1]
        assert launch.closed and launch.launched == {0}  # nothing was launched into the buffer after it was dropped
        assert engine.pool.held == 0
        await (await engine.save(3, state)).wait()
        out = {"a": torch.zeros(50_000), "opt": {"b": torch.zeros(300, 10, dtype=torch.float64)}}
        assert (await engine.load(out, tiers=["host"])).step == 3 and torch.all(out["opt"]["b"] == 9.0)


class Broken(Recording):
    """Launches whose copies can never be waited for (a device that failed)."""

    def launch(self, known, buffer, events):
        launch = super().launch(known, buffer, events)

        def synchronize():
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        launch.fits = lambda plan, devices: False
        launch.synchronize = synchronize
        return launch


async def test_a_launch_that_cannot_be_waited_for_fails_the_save_and_never_hangs(make_config):
    async with tc.Engine(make_config(max_inflight=1)) as engine:
        engine._saver.early = Broken()
        await (await engine.save(1, state(1.0))).wait()
        with pytest.raises(RuntimeError, match="illegal memory access"):
            await asyncio.wait_for(engine.save(2, state(2.0)), 30)
