"""Python's full garbage collections hold the GIL for a time that grows with every live object of the process
(~0.3 s with 100,000 tensors), so a save or load must not feed them: no reference cycles left behind, and no
objects kept per tensor by a save once its staging buffers are filled. Counted, not timed: gc.get_count()[0]
is the tracked objects allocated and not freed since the last collection."""
import gc

import torch

import tiered_ckpt as tc

N = 3000


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
            assert grown < N // 10, f"save {step} left {grown} more tracked objects for {N} tensors"
