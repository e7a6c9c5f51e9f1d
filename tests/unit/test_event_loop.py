"""Nothing heavy runs on the event loop: copies, checksums, allocations of part-sized buffers, manifest
coding and file-system calls go to threads, so saves in flight keep moving while the loop serves others.

Measured as CPU time of the loop's thread per callback (time.thread_time), which waiting for the GIL does
not inflate: a 64 MiB copy or zero-fill on the loop costs tens of ms of it, bookkeeping well under one."""
import asyncio
import gc
import threading
import time

import pytest
import torch

import tiered_ckpt as tc
from tiered_ckpt.load.verify import verify

LIMIT = 0.005  # seconds of the loop thread's CPU in one callback


def _where(handle) -> str:
    """The chain of coroutines a callback resumes, innermost last, with the line each stands at (or the
    callback's name): where the loop's time went."""
    task = getattr(handle._callback, "__self__", None)
    coro = task.get_coro() if isinstance(task, asyncio.Task) else None
    chain = []
    while coro is not None and hasattr(coro, "cr_frame"):
        if coro.cr_frame is not None:
            chain.append(f"{coro.cr_frame.f_code.co_name}:{coro.cr_frame.f_lineno}")
        coro = coro.cr_await
    if not chain:
        callback = handle._callback
        return getattr(callback, "__qualname__", type(callback).__name__)
    return " > ".join(chain)


class LoopCpu:
    """Wraps asyncio's Handle._run (what runs every callback and task step) and keeps the costliest."""

    def __init__(self, monkeypatch):
        self.worst: list[tuple[float, str]] = []
        real = asyncio.events.Handle._run
        monitor = self
        self.loop_thread = threading.get_ident()
        self.in_gc = 0.0  # the loop thread's CPU time in garbage collections (the interpreter's, not ours)
        started: list[float] = []

        def collecting(phase, info):
            if threading.get_ident() != monitor.loop_thread:
                return
            if phase == "start":
                started.append(time.thread_time())
            elif started:
                monitor.in_gc += time.thread_time() - started.pop()

        gc.callbacks.append(collecting)
        self.stop = lambda: gc.callbacks.remove(collecting)

        def timed(handle):
            where = _where(handle)  # (before the clock starts: naming a callback is not its cost)
            start, collected = time.thread_time(), monitor.in_gc
            try:
                return real(handle)
            finally:
                spent = time.thread_time() - start - (monitor.in_gc - collected)
                if spent > LIMIT:
                    monitor.worst.append((spent, f"{where} -> {_where(handle)}"))

        monkeypatch.setattr(asyncio.events.Handle, "_run", timed)

    def over(self, limit: float) -> list[tuple[float, str]]:
        return sorted((w for w in self.worst if w[0] > limit), reverse=True)


@pytest.mark.timeout(300)
async def test_save_load_verify_and_export_of_64_mib_parts_never_block_the_loop(make_config, tmp_path, monkeypatch):
    state = {"a": torch.randn(40 * 2**20 // 4), "b": torch.randn(100 * 2**20 // 4), "c": torch.randn(1000)}
    config = make_config(part_size="64MiB", tiers=[{"capacity": "2GiB", "keep_last": 2}, {}])
    async with tc.Engine(config) as engine:
        await (await engine.save(1, state)).wait()  # the first save allocates its buffers: not measured
        loop_cpu = LoopCpu(monkeypatch)
        await (await engine.save(2, state)).wait()
        out = {k: torch.empty_like(v) for k, v in state.items()}
        await engine.load(out, tiers=["disk"])
        await engine.load(out, tiers=["host"])
        reports = await verify(engine.store.io, await engine.status(2), await engine.read_manifest(2))
        await engine.export(tmp_path / "out.safetensors", to="safetensors")
        loop_cpu.stop()
        assert all(r.ok for r in reports) and torch.equal(out["b"], state["b"])
        assert not loop_cpu.over(LIMIT), loop_cpu.over(LIMIT)[:5]
