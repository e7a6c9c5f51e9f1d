"""Python's full garbage collections hold the GIL for a time that grows with every live object of the process
(~0.3 s with 100,000 tensors), so a save or load must not feed them: no reference cycles left behind, and no
objects kept per tensor by a save once its staging buffers are filled. Counted, not timed: gc.get_count()[0]
is the tracked objects allocated and not freed since the last collection."""
import asyncio
import gc

import torch

import tiered_ckpt as tc

N = 3000
# A save leaves a fixed few hundred tracked objects whatever N (its records, tasks and futures: 190-450 measured on
# a quiet machine, more under load); an object per tensor would leave N or more. The bound sits between the two.
PER_TENSOR_BOUND = N // 4


def _state() -> dict[str, torch.Tensor]:
    return {f"layer{i}.scale": torch.full((4,), float(i)) for i in range(N)}


async def _without_gc(coro) -> tuple[int, int]:
    """(tracked objects left alive, objects left in reference cycles) by awaiting `coro` with collections off."""
    gc.collect()
    gc.disable()
    try:
        await coro
        grown = gc.get_count()[0]
        return grown, gc.collect()
    finally:
        gc.enable()


async def test_save_and_load_leave_no_reference_cycles(engine):
    state = _state()

    async def save(step: int) -> None:
        await (await engine.save(step, state)).wait()

    await save(1)
    _, cyclic = await _without_gc(save(2))
    assert cyclic < N // 20, f"a save left {cyclic} objects in reference cycles for {N} tensors"
    target = {k: torch.zeros(4) for k in state}
    _, cyclic = await _without_gc(engine.load(target))
    assert cyclic < N // 20, f"a load left {cyclic} objects in reference cycles for {N} tensors"
    assert all(torch.equal(target[k], v) for k, v in state.items())


async def test_a_steady_save_allocates_nothing_per_tensor(make_config):
    state = _state()

    async def save(step: int) -> None:
        await (await engine.save(step, state)).wait()

    async with tc.Engine(make_config(tiers=[{"keep_last": 2}])) as engine:
        for step in range(1, 5):  # the first saves plan and fill fresh staging buffers (their views are kept)
            await save(step)
        for step in range(5, 8):
            grown, _ = await _without_gc(save(step))
            assert grown < PER_TENSOR_BOUND, f"save {step} left {grown} more tracked objects for {N} tensors"


async def test_after_reserve_the_first_saves_allocate_nothing_per_tensor(make_config):
    """reserve() makes every staging buffer with its views of the state's tensors (an object per tensor each),
    so no save makes them later, and none sets off a full collection then."""
    state = _state()
    async with tc.Engine(make_config(tiers=[{"keep_last": 2}])) as engine:
        reservation = await engine.reserve(state)
        assert reservation.made >= 2
        for step in range(1, 5):  # (the first save's few hundred objects are its tiers' first records, not per tensor)
            grown, _ = await _without_gc(_save_and_wait(engine, step, state))
            assert grown < PER_TENSOR_BOUND, f"save {step} after reserve() left {grown} more tracked objects for {N} tensors"


async def test_a_buffer_made_ahead_comes_with_its_views(make_config):
    """The memory tier's next staging buffer is made in the background after a save (pool.prepare_next); its
    views are made there too, so the save that takes it allocates nothing per tensor. (keep_last 1: two buffers
    in all, so the save that takes it makes none ahead in its turn.)"""
    state = _state()
    async with tc.Engine(make_config(tiers=[{"keep_last": 1}])) as engine:
        await _save_and_wait(engine, 1, state)
        await engine.pool.settle()  # the buffer made ahead is free now
        assert len(engine.pool.free) == 1
        grown, _ = await _without_gc(_save_and_wait(engine, 2, state))
        assert grown < PER_TENSOR_BOUND, f"save 2 left {grown} more tracked objects for {N} tensors"


async def _save_and_wait(engine: tc.Engine, step: int, state: dict[str, torch.Tensor]) -> None:
    await (await engine.save(step, state)).wait()


async def test_settle_waits_for_the_views_of_a_buffer_made_ahead(make_config, monkeypatch):
    """settle() and clear() wait for the buffer being made ahead until it is in the pool, its views included: a
    buffer still making its views must not be missed by clear() (it would outlive the engine)."""
    import threading

    from tiered_ckpt.save.staging_buffer import StagingBuffer

    gate, calls, original = threading.Event(), [], StagingBuffer.views_for

    def gated(self, plan):
        calls.append(self)
        if len(calls) > 1:  # the first is save 1's own buffer; the next, the buffer made ahead
            assert gate.wait(60)
        return original(self, plan)

    monkeypatch.setattr(StagingBuffer, "views_for", gated)
    state = _state()
    async with tc.Engine(make_config(tiers=[{"keep_last": 1}])) as engine:
        try:
            await _save_and_wait(engine, 1, state)
            for _ in range(3000):  # until the buffer made ahead is making its views (held at the gate)
                if len(calls) == 2:
                    break
                await asyncio.sleep(0.01)
            settling = asyncio.ensure_future(engine.pool.settle())
            for _ in range(20):
                await asyncio.sleep(0)
            assert len(calls) == 2 and not settling.done()  # still making the views: settle() waits
        finally:
            gate.set()
        await settling
        assert len(engine.pool.free) == 1


def test_staging_buffers_made_and_unmapped_leave_no_reference_cycles(shm_dir):
    """Each staging buffer in the memory tier's files maps them through libc. Loading libc per buffer (a CDLL
    makes its own function-pointer classes, kept until the buffer is unmapped) left ~24 objects in cycles per
    buffer given back: with a few given back during a save, the save test above failed now and then."""
    from tiered_ckpt.save.mapped import MappedParts

    MappedParts(shm_dir / "warm", 8192, 4096)  # the first one: libc, and ctypes' own caches
    gc.collect()
    gc.disable()
    try:
        buffers = [MappedParts(shm_dir / f"b{i}", 8192, 4096) for i in range(3)]
        made = gc.collect()
        del buffers  # unmapped
        given_back = gc.collect()
    finally:
        gc.enable()
    assert made + given_back < 20, f"3 staging buffers left {made} + {given_back} objects in reference cycles"
