"""Many small tensors (an optimizer's per-parameter scalars, a model of many small layers): what a save and a
load cost when the work is per tensor, not per byte, and how long the event loop is held up meanwhile."""
from __future__ import annotations

import asyncio
import gc
import statistics
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


def _config(job: str, disk: Path, shm: Path) -> Any:
    return parse_config({"engine": {"job": job, "index": f"file://{disk}/index", "part_size": "64MiB"},
                         "tiers": [{"name": "host", "kind": "memory", "path": str(shm), "keep_last": 2},
                                   {"name": "disk", "kind": "local", "path": str(disk / "parts"), "keep_last": 2}]})


async def measure_small(count: int, disk: Path, shm: Path, *, automatic_gc: bool = True) -> dict[str, float]:
    """Saves 1-5 (the first plans, the next ones fill fresh staging buffers, later ones reuse them) and a
    load; then, for another job, `reserve()` and saves 1-3 after it. `automatic_gc=False` runs them as trainers
    that turn Python's automatic collections off do."""
    config = _config("small", disk, shm)
    state = {f"layer{i}.scale": torch.full((16,), float(i)) for i in range(count)}
    target = {k: torch.zeros(16) for k in state}
    out: dict[str, float] = {"tensors": count, "automatic_gc": automatic_gc}

    async def save_and_wait(step: int) -> None:
        await (await engine.save(step, state)).wait()

    was_enabled = gc.isenabled()
    gc.collect()
    if not automatic_gc:
        gc.disable()
    try:
        async with Engine(config) as engine:
            _, out["first_save_s"], out["first_save_stall_s"] = await _timed(save_and_wait(1))
            _, out["save_s"], out["save_stall_s"] = await _timed(save_and_wait(2))
            later = [await _timed(save_and_wait(step)) for step in (3, 4, 5)]
            out["later_save_s"] = statistics.median(seconds for _, seconds, _ in later)
            out["later_save_stall_s"] = max(stall for _, _, stall in later)
            manifest = await engine.read_manifest(5)
            out["manifest_bytes"] = len(await engine.store.index.get_manifest(engine.job, 5))
            out["data_bytes"] = manifest.nbytes
            _, out["load_s"], out["load_stall_s"] = await _timed(engine.load(target))
        async with Engine(_config("small-reserved", disk, shm)) as engine:
            _, out["reserve_s"], out["reserve_stall_s"] = await _timed(engine.reserve(state))
            reserved = [await _timed(save_and_wait(step)) for step in (1, 2, 3)]
            out["reserved_save_s"] = statistics.median(seconds for _, seconds, _ in reserved)
            out["reserved_save_stall_s"] = max(stall for _, _, stall in reserved)
    finally:
        if was_enabled:
            gc.enable()
    if not all(torch.equal(target[k], v) for k, v in state.items()):
        raise AssertionError("the small-tensor load did not reproduce the state")
    return out


def report_small(runs: list[dict[str, float]]) -> str:
    r = runs[0]
    lines = [f"{r['tensors']:,} tensors of 16 floats ({r['data_bytes'] / 1e6:.1f} MB of data, manifest "
             f"{r['manifest_bytes'] / 1e6:.1f} MB). Seconds until durable on both tiers, and the longest time the "
             f"event loop was held up.", ""]
    head = "| operation |" + "".join(f" s (GC {'on' if x['automatic_gc'] else 'off'}) | stall ms |" for x in runs)
    lines += [head, "|---|" + "---:|---:|" * len(runs)]
    for name, key in (("first save (plans, allocates a staging buffer)", "first_save"),
                      ("second save (fills a fresh staging buffer)", "save"),
                      ("saves 3-5 (median s, longest stall)", "later_save"), ("load", "load"),
                      ("reserve() (another job: makes every staging buffer and its views)", "reserve"),
                      ("saves 1-3 after reserve() (median s, longest stall)", "reserved_save")):
        lines.append(f"| {name} |" + "".join(f" {x[key + '_s']:.2f} | {x[key + '_stall_s'] * 1e3:.0f} |" for x in runs))
    return "\n".join(lines)
