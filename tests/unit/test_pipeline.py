import asyncio
import random

import pytest

from tiered_ckpt.errors import TierFull, TierTimeout, TierUnavailable
from tiered_ckpt.storage.pipeline import TierPipeline


def pipeline(**kw):
    args = dict(workers=2, inflight=100, retries=3, timeout=5.0, backoff=0.001)
    args.update(kw)
    return TierPipeline("t", **args)


def fails_twice(calls: list[int]):
    """An operation that fails with a retryable error twice, then returns "ok"; each call appends to `calls`."""

    async def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise TierUnavailable("connection reset", tier="t")
        return "ok"

    return flaky


async def test_retryable_errors_are_retried_then_succeed():
    p, calls = pipeline(), []
    flaky = fails_twice(calls)
    assert await p.submit(10, flaky, "op") == "ok"
    assert len(calls) == 3 and p.retried == 2


async def test_retry_jitter_leaves_the_training_process_rng_alone():
    """A retry during a save must not draw from Python's global RNG: the training process's (the Trainer saves
    and restores it) would then differ between a run that retried and one that did not."""
    p, calls = pipeline(), []
    flaky = fails_twice(calls)
    before = random.getstate()
    assert await p.submit(10, flaky, "op") == "ok"
    assert p.retried == 2 and random.getstate() == before


async def test_retries_are_bounded():
    p, calls = pipeline(retries=2), []

    async def down():
        calls.append(1)
        raise TierUnavailable("down", tier="t")

    with pytest.raises(TierUnavailable) as err:
        await p.submit(10, down, "op")
    assert len(calls) == 3 and "gave up after 3 attempts" in "".join(err.value.__notes__)


async def test_non_retryable_errors_fail_at_once():
    p, calls = pipeline(), []

    async def full():
        calls.append(1)
        raise TierFull("full", tier="t")

    with pytest.raises(TierFull):
        await p.submit(10, full, "op")
    assert len(calls) == 1


async def test_timeout_becomes_tier_timeout_and_is_retried():
    p, calls = pipeline(timeout=0.05, retries=1), []

    async def stall():
        calls.append(1)
        await asyncio.sleep(10)

    with pytest.raises(TierTimeout, match="longer than 0.05s"):
        await p.submit(1, stall, "write x")
    assert len(calls) == 2


async def test_a_caller_cancelled_during_an_operation_is_cancelled_not_timed_out():
    """Cancelling the caller cancels the operation and raises CancelledError, never a TierTimeout, with no
    retry, and gives the budget back."""
    p, started, ended = pipeline(timeout=5.0, retries=3), asyncio.Event(), []

    async def stall():
        started.set()
        try:
            await asyncio.sleep(10)
        finally:
            ended.append(1)

    task = asyncio.create_task(p.submit(7, stall, "write x"))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ended == [1] and p.retried == 0
    assert p._budget.used == 0


def concurrency_probe():
    running, peak = {"bytes": 0, "ops": 0}, {"bytes": 0, "ops": 0}

    async def op(n):
        running["bytes"] += n
        running["ops"] += 1
        peak["bytes"] = max(peak["bytes"], running["bytes"])
        peak["ops"] = max(peak["ops"], running["ops"])
        await asyncio.sleep(0.01)
        running["bytes"] -= n
        running["ops"] -= 1

    return op, peak


async def test_the_byte_budget_bounds_bytes_in_flight():
    p = pipeline(workers=10, inflight=100)
    op, peak = concurrency_probe()
    await asyncio.gather(*(p.submit(40, lambda: op(40), "op") for _ in range(10)))
    assert peak == {"bytes": 80, "ops": 2}  # the budget, not the 10 workers, is the limit here
    # an item larger than the whole budget still runs, alone
    op, peak = concurrency_probe()
    await asyncio.gather(p.submit(500, lambda: op(500), "big"), p.submit(40, lambda: op(40), "small"))
    assert peak == {"bytes": 500, "ops": 1}


async def test_workers_bound_operations_in_flight():
    p = pipeline(workers=3, inflight=10_000)
    op, peak = concurrency_probe()
    await asyncio.gather(*(p.submit(10, lambda: op(10), "op") for _ in range(12)))
    assert peak == {"bytes": 30, "ops": 3}  # the workers, not the budget, are the limit here


def test_bounce_buffers_are_reused_by_identity():
    from tiered_ckpt.storage.verified_read import BouncePool

    pool = BouncePool(2)
    a, b = pool.take(65536), pool.take(4000)
    pool.give(a)
    pool.give(b)  # two free buffers: taking one must not compare tensors elementwise
    assert pool.take(65536) is a and pool.take(100) is b
    pool.give(b)
    assert pool.take(70000) is not b  # too small: replaced, not grown in place


async def test_save_turns_keep_the_newest_waiting_save_whatever_the_order_of_arrival():
    from tiered_ckpt.storage.pipeline import SaveTurns

    turns = SaveTurns()
    assert await turns.take(1) is None  # writing
    newer = asyncio.ensure_future(turns.take(5))
    await asyncio.sleep(0)
    assert await turns.take(3) == 5  # arrived late, older than the one waiting: skipped for it
    newest = asyncio.ensure_future(turns.take(7))
    await asyncio.sleep(0)
    assert await newer == 7
    turns.give()
    assert await newest is None  # its turn
    turns.give()
    assert await turns.take(8) is None  # idle again


async def test_save_turns_without_skipping_queue_every_save_in_order():
    from tiered_ckpt.storage.pipeline import SaveTurns

    turns = SaveTurns(skip=False)
    assert await turns.take(1) is None
    waiting = [asyncio.ensure_future(turns.take(s)) for s in (2, 3)]
    await asyncio.sleep(0)
    turns.give()
    assert await waiting[0] is None and not waiting[1].done()
    turns.give()
    assert await waiting[1] is None
