"""Cancels and closes at awkward moments: a cancelled save never lets later changes into its checkpoint nor
keeps a staging buffer; close() refuses new work, survives a cancel and is shared by every caller."""

import asyncio
import os
import signal
import threading
import time

import pytest
import torch

import tiered_ckpt as tc
import tiered_ckpt.save.job as job_module
import tiered_ckpt.save.mapped as mapped

from .common import load_values, state_of


def slowed(monkeypatch, module, name, seconds):
    """`module.name` taking `seconds` longer (a slow copy, a busy machine's stat): the window a cancel hits.
    Returns an event set once a call is inside that window."""
    original, inside = getattr(module, name), threading.Event()

    def slow(*args, **kwargs):
        inside.set()
        time.sleep(seconds)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, slow)
    return inside


async def cancelled_inside(engine, step, state, inside):
    """Start save(step) and cancel it once it is inside the slowed call."""
    saving = asyncio.ensure_future(engine.save(step, state))
    assert await asyncio.to_thread(inside.wait, 20)
    saving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await saving


async def test_a_plain_save_cancelled_during_its_copy_keeps_what_the_state_held(make_config, monkeypatch):
    """The caller cancels save() while the copy runs, then changes its tensors. The old code let the copy
    (still running) take those changes into the checkpoint it went on to commit."""
    async with tc.Engine(make_config()) as engine:
        await (await engine.save(1, state_of(1.0))).wait()
        inside = slowed(monkeypatch, job_module, "stage", 0.3)
        state = state_of(5.0)
        await cancelled_inside(engine, 5, state, inside)
        state["w"].fill_(-7.0)  # the caller has its tensors back
        await engine.wait_all()
        _, out = await load_values(engine, step=5)
        assert torch.all(out["w"] == 5.0)


async def test_a_plain_save_cancelled_during_its_copy_is_still_recorded(make_config, monkeypatch):
    """The save goes on after the cancel, so its records come as for any save (on_event, the JSON lines,
    Prometheus), and the time rule of should_save() counts from it. The old code recorded nothing of it."""
    records = []
    async with tc.Engine(make_config()) as engine:
        engine.on_event(records.append)
        await (await engine.save(1, state_of(1.0))).wait()
        inside = slowed(monkeypatch, job_module, "stage", 0.3)
        await cancelled_inside(engine, 5, state_of(5.0), inside)
        await engine.wait_all()
    saves = [r for r in records if isinstance(r, tc.SaveEvent)]
    assert [(r.step, r.ok) for r in saves] == [(1, True), (5, True)]
    assert [r.committed for r in saves][1] == saves[0].committed != ()


async def test_the_last_save_after_sigterm_cancelled_during_its_copy_still_ends_the_process(make_config,
                                                                                         monkeypatch):
    """should_save() said yes for a SIGTERM; the caller cancels that save during its copy. The save goes on, and
    once it is done on every tier the signal is delivered again (here to the test's own handler), as for a
    save that returned. The old code never delivered it: the process went on training after its SIGTERM."""
    delivered = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: delivered.set())
    try:
        async with tc.Engine(make_config(save_on_sigterm=True)) as engine:
            await (await engine.save(1, state_of(1.0))).wait()
            os.kill(os.getpid(), signal.SIGTERM)  # to the engine's handler: the next should_save says yes
            assert await engine.should_save(2)
            inside = slowed(monkeypatch, job_module, "stage", 0.3)
            await cancelled_inside(engine, 2, state_of(2.0), inside)
            await engine.wait_all()
            for _ in range(100):  # the handler runs in this (the main) thread, between two bytecodes
                if delivered.is_set():
                    break
                await asyncio.sleep(0.05)
            assert delivered.is_set()
            assert 2 in [c.step async for c in engine.list() if c.complete]
    finally:
        signal.signal(signal.SIGTERM, previous)


async def test_the_last_save_after_sigterm_cancelled_while_it_waits_for_its_tiers_still_ends_the_process(
        make_config, monkeypatch):
    """The last save waits for every tier before the signal goes on; a cancel there (asyncio.wait_for) used to
    end that wait, and the process trained on after its SIGTERM."""
    from tiered_ckpt.storage.tiers.local import LocalTier

    delivered = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: delivered.set())
    try:
        async with tc.Engine(make_config(save_on_sigterm=True)) as engine:
            await (await engine.save(1, state_of(1.0))).wait()
            os.kill(os.getpid(), signal.SIGTERM)
            assert await engine.should_save(2)
            slowed(monkeypatch, LocalTier, "_write_sync", 0.2)  # the disk tier: a slow wait for every tier
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(engine.save(2, state_of(2.0)), 0.05)
            await engine.wait_all()
            for _ in range(100):
                if delivered.is_set():
                    break
                await asyncio.sleep(0.05)
            assert delivered.is_set()
    finally:
        signal.signal(signal.SIGTERM, previous)


async def test_a_save_cancelled_while_a_reused_buffer_is_checked_gives_it_back(make_config, monkeypatch):
    """A buffer of more than 16 part files is checked in a thread; a cancel there used to leave it held for
    ever, and every later save waited for a buffer."""
    state = {"w": torch.full((1 << 19,), 1.0)}  # 2 MiB in 64 KiB parts: 32 part files
    async with tc.Engine(make_config(tiers=[{"keep_last": 1}])) as engine:
        for step in (1, 2, 3):
            await (await engine.save(step, state)).wait()
        inside = slowed(monkeypatch, mapped.MappedParts, "intact", 0.3)
        await cancelled_inside(engine, 4, state, inside)
        await engine.wait_all()
        assert engine.pool.held == 0
        await (await asyncio.wait_for(engine.save(5, state), 20)).wait()


async def test_close_refuses_new_saves_and_loads_and_is_shared_by_every_caller(make_config, monkeypatch):
    slowed(monkeypatch, job_module, "stage", 0.3)
    engine = await tc.Engine(make_config()).open()
    handle = await engine.save(1, state_of(1.0), lazy=True)
    first = asyncio.ensure_future(engine.close())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="engine is closing"):
        await engine.save(2, state_of(2.0))
    with pytest.raises(RuntimeError, match="engine is closing"):
        await engine.load(state_of(0.0))
    await engine.close()  # a second close() returns only when the closing is done
    assert handle.done() and first.done()
    with pytest.raises(RuntimeError, match="engine is closed"):
        await engine.save(3, state_of(3.0))


async def test_a_cancelled_close_goes_on_and_a_second_close_waits_for_it(make_config, monkeypatch):
    """The old code marked the engine closed at a second close() and closed nothing: the writer lease stayed
    held, so a new engine of the job in this process was refused as a second writer."""
    slowed(monkeypatch, job_module, "stage", 0.3)
    engine = await tc.Engine(make_config()).open()
    await engine.save(1, state_of(1.0), lazy=True)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(engine.close(), 0.05)
    await engine.close()
    async with tc.Engine(make_config()) as again:
        await (await again.save(2, state_of(2.0))).wait()
        assert [s.step async for s in again.list() if s.is_complete] == [1, 2]
