"""Many small tensors (an optimizer's per-parameter scalars, a model of many small layers): what a save and a
load cost when the work is per tensor, not per byte, and how long the event loop is held up meanwhile."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import torch

from .. import Engine
from ..config import parse_config


async def _longest_stall(stop: asyncio.Event) -> float:
    """The longest time the event loop took to come back to a task that sleeps 1 ms at a time."""
    longest, last = 0.0, time.perf_counter()
    while not stop.is_set():
        await asyncio.sleep(0.001)
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    return longest


async def _timed(coro: Any) -> tuple[Any, float, float]:
    stop = asyncio.Event()
    watcher = asyncio.create_task(_longest_stall(stop))
    await asyncio.sleep(0.005)
    t = time.perf_counter()
    result = await coro
    seconds = time.perf_counter() - t
    stop.set()
    return result, seconds, await watcher


async def measure_small(count: int, disk: Path, shm: Path) -> dict[str, float]:
    config = parse_config({"engine": {"job": "small", "index": f"file://{disk}/index", "part_size": "64MiB"},
                           "tiers": [{"name": "host", "kind": "memory", "path": str(shm), "keep_last": 2},
                                     {"name": "disk", "kind": "local", "path": str(disk / "parts"), "keep_last": 2}]})
    state = {f"layer{i}.scale": torch.full((16,), float(i)) for i in range(count)}
    out: dict[str, float] = {"tensors": count}

    async def save_and_wait(step: int) -> None:
        await (await engine.save(step, state)).wait()

    async with Engine(config) as engine:
        _, out["first_save_s"], out["first_save_stall_s"] = await _timed(save_and_wait(1))
        _, out["save_s"], out["save_stall_s"] = await _timed(save_and_wait(2))
        manifest = await engine.read_manifest(2)
        out["manifest_bytes"] = len(await engine.index.get_manifest(engine.job, 2))
        out["data_bytes"] = manifest.nbytes
        target = {k: torch.zeros(16) for k in state}
        _, out["load_s"], out["load_stall_s"] = await _timed(engine.load(target))
    if not all(torch.equal(target[k], v) for k, v in state.items()):
        raise AssertionError("the small-tensor load did not reproduce the state")
    return out


def report_small(r: dict[str, float]) -> str:
    return "\n".join([
        f"{r['tensors']:,} tensors of 16 floats ({r['data_bytes'] / 1e6:.1f} MB of data, manifest "
        f"{r['manifest_bytes'] / 1e6:.1f} MB)", "",
        "| operation | seconds | longest event-loop stall (ms) |", "|---|---:|---:|",
        f"| first save (plans), until durable | {r['first_save_s']:.2f} | {r['first_save_stall_s'] * 1e3:.0f} |",
        f"| save (cached plan), until durable | {r['save_s']:.2f} | {r['save_stall_s'] * 1e3:.0f} |",
        f"| load | {r['load_s']:.2f} | {r['load_stall_s'] * 1e3:.0f} |"])
