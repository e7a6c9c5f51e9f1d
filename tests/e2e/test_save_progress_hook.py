"""`on_tier_done`: how a training loop (examples/train_gpt.py) learns of each tier's commit without blocking."""
from __future__ import annotations

import asyncio
import threading

import torch

import tiered_ckpt as tc
from tiered_ckpt.save.handle import SaveHandle, TierDone


def test_checkpointer_reports_each_tiers_commit_on_its_loop_thread(make_config):
    state = {"w": torch.arange(1000, dtype=torch.float32), "step": 1}
    seen: list[tuple[TierDone, threading.Thread]] = []
    both = threading.Event()

    def record(done: TierDone) -> None:
        seen.append((done, threading.current_thread()))
        if len(seen) == 2:
            both.set()

    with tc.Checkpointer(make_config()) as ckpt:
        handle = ckpt.save(1, state)
        handle.on_tier_done(record)  # returns at once: nothing here waits for a tier
        assert both.wait(30), seen
        handle.wait()
        late: list[TierDone] = []
        reported = threading.Event()
        handle.on_tier_done(lambda done: (late.append(done), len(late) == 2 and reported.set()))
        assert reported.wait(30)  # registered after the tiers finished: still told, once per tier
    assert sorted(d.tier for d, _ in seen) == sorted(d.tier for d in late) == ["disk", "host"]
    for done, thread in seen:
        assert done.step == 1 and done.committed and done.error is None and done.superseded_by is None
        assert 0 < done.seconds < 30
        assert thread is not threading.main_thread()


async def test_the_hook_reports_failures_skips_and_cancellations_and_survives_a_raising_callback():
    handle = SaveHandle(7, ["host", "disk", "s3"])
    got: dict[str, TierDone] = {}

    def broken(done: TierDone) -> None:
        raise RuntimeError("a buggy progress printer")

    loop = asyncio.get_running_loop()
    errors: list[dict] = []
    loop.set_exception_handler(lambda _, context: errors.append(context))
    try:
        handle.on_tier_done(broken)
        handle.on_tier_done(lambda done: got.__setitem__(done.tier, done))
        handle.set_staged()
        handle.durable_at["host"] = 0.25
        handle.set_done("host")
        handle.set_skipped("disk", 9)
        handle.cancel()  # s3 never finished
        for _ in range(3):
            await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(None)
    assert got["host"] == TierDone(7, "host", 0.25) and got["host"].committed
    assert got["disk"].superseded_by == 9 and got["disk"].error is None and not got["disk"].committed
    assert isinstance(got["s3"].error, asyncio.CancelledError) and not got["s3"].committed
    assert len(errors) == 3 and all("buggy" in str(e.get("exception")) for e in errors)
