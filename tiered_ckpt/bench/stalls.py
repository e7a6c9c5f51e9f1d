"""Event-loop stalls against the tensor count: the longest time a task on the loop waited to run during each
save, load and close of N tensors of 16 floats.

The setup an application that keeps the loop busy sees: a task that sleeps 5 ms at a time runs beside the
engine and records the longest gap over its sleep (`--ticker`); 8 MiB parts, so a state of many tensors is many
parts; the loads go into tensors made just before them (a resume's fresh model), from the memory tier alone and
from the disk tier alone. Each run is a fresh process (a run's garbage and collector state do not leak into the
next), with Python's automatic collection on or off (`--gc`). Not a test: figures vary with the machine's load,
so compare trees run alternately in one session (docs/benchmarks.md, *Event-loop stalls against the tensor
count*).

    python -m tiered_ckpt.bench.stalls --tensors 100000,300000 --gc on,off [--json out.json]
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Awaitable

OPERATIONS = ("first save", "second save", "load (memory tier)", "load (disk tier)", "close")


async def _ticker(stop: asyncio.Event, gaps: list[float], period: float) -> None:
    last = time.perf_counter()
    while not stop.is_set():
        await asyncio.sleep(period)
        now = time.perf_counter()
        gaps.append(now - last - period)
        last = now


class _LoopCpu:
    """The most CPU time of the loop's thread that one callback took (time.thread_time, which neither waiting
    for the GIL nor other processes on the machine inflate): what the loop itself ran, where the ticker's gap
    also counts threads that held the GIL and a busy machine."""

    def __init__(self) -> None:
        self.longest = 0.0
        real = self._real = asyncio.events.Handle._run
        watch = self

        def timed(handle: asyncio.Handle) -> None:
            start = time.thread_time()
            try:
                real(handle)
            finally:
                watch.longest = max(watch.longest, time.thread_time() - start)

        asyncio.events.Handle._run = timed  # type: ignore[method-assign]


async def _longest_stall(work: Awaitable[Any], period: float, cpu: _LoopCpu) -> tuple[float, float, float]:
    """(seconds `work` took, the longest stall of the loop meanwhile, the most loop CPU one callback took)."""
    stop, gaps = asyncio.Event(), [0.0]
    ticker = asyncio.create_task(_ticker(stop, gaps, period))
    await asyncio.sleep(4 * period)
    gaps[:] = [0.0]
    cpu.longest = 0.0
    start = time.perf_counter()
    await work
    seconds = time.perf_counter() - start
    stop.set()
    await ticker
    return seconds, max(gaps), cpu.longest


async def measure(count: int, folder: Path, shm: Path, *, period: float = 0.005, part_size: str = "8MiB",
                  ) -> dict[str, tuple[float, float, float]]:
    """Saves 1 and 2 of `count` tensors to a memory and a disk tier, a load from each into fresh tensors, then
    close: {operation: (seconds, longest stall, longest loop callback's CPU)}."""
    import torch

    from .. import Engine
    from ..config import parse_config

    config = parse_config({"engine": {"job": "stalls", "index": f"file://{folder}/index", "part_size": part_size},
                           "tiers": [{"name": "host", "kind": "memory", "path": str(shm), "keep_last": 2},
                                     {"name": "disk", "kind": "local", "path": str(folder / "parts"),
                                      "keep_last": 2}]})
    state = {f"layer{i}.scale": torch.full((16,), float(i)) for i in range(count)}
    out: dict[str, tuple[float, float, float]] = {}
    cpu = _LoopCpu()
    engine = await Engine(config).open()

    async def save(step: int) -> None:
        await (await engine.save(step, state)).wait()

    out["first save"] = await _longest_stall(save(1), period, cpu)
    out["second save"] = await _longest_stall(save(2), period, cpu)
    for name, tier in (("load (memory tier)", "host"), ("load (disk tier)", "disk")):
        target = {k: torch.zeros(16) for k in state}  # fresh tensors, as a resumed process has
        out[name] = await _longest_stall(engine.load(target, tiers=[tier]), period, cpu)
        if not torch.equal(target[f"layer{count - 1}.scale"], state[f"layer{count - 1}.scale"]):
            raise AssertionError(f"the {name} did not reproduce the state")
        del target
    out["close"] = await _longest_stall(engine.close(), period, cpu)
    return out


def _one(count: int, automatic_gc: bool, period: float, part_size: str) -> dict[str, Any]:
    if not automatic_gc:
        gc.disable()
    with tempfile.TemporaryDirectory() as folder, tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        figures = asyncio.run(measure(count, Path(folder), Path(shm), period=period, part_size=part_size))
    return {"tensors": count, "automatic_gc": automatic_gc, "figures": figures}


def run(counts: list[int], gcs: list[bool], *, period: float, part_size: str) -> list[dict[str, Any]]:
    """Each (count, gc) in a fresh process of this interpreter, with this process's import path."""
    runs = []
    for count in counts:
        for automatic_gc in gcs:
            done = subprocess.run([sys.executable, "-m", "tiered_ckpt.bench.stalls", "--one",
                                   f"{count},{int(automatic_gc)},{period},{part_size}"],
                                  capture_output=True, text=True, check=True)
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(report([runs[-1]]).splitlines()[-1], flush=True)
    return runs


def report(runs: list[dict[str, Any]]) -> str:
    head = "| tensors | GC | " + " | ".join(OPERATIONS) + " |"
    lines = [head, "|---:|---|" + "---:|" * len(OPERATIONS)]
    for r in runs:
        cells = []
        for op in OPERATIONS:
            seconds, stall, cpu = r["figures"][op]
            cells.append(f"{seconds:.2f} s / **{stall * 1e3:.0f}** / {cpu * 1e3:.0f} ms")
        lines.append(f"| {r['tensors']:,} | {'on' if r['automatic_gc'] else 'off'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tiered_ckpt.bench.stalls", description=__doc__.split("\n\n")[0])
    p.add_argument("--tensors", default="100000,300000,1000000", help="comma-separated tensor counts")
    p.add_argument("--gc", default="on,off", help="automatic garbage collection: on, off or on,off")
    p.add_argument("--ticker", type=float, default=0.005, help="the watching task's sleep, seconds")
    p.add_argument("--part-size", default="8MiB")
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument("--one", help=argparse.SUPPRESS)  # count,gc,period,part_size: one run, JSON on stdout
    args = p.parse_args(argv)
    if args.one:
        count, automatic_gc, period, part_size = args.one.split(",")
        print(json.dumps(_one(int(count), automatic_gc == "1", float(period), part_size)))
        return 0
    print(f"seconds / longest event-loop stall ({args.ticker * 1e3:.0f} ms ticker) / most loop CPU in one callback, "
          f"{args.part_size} parts")
    print(report([]))
    runs = run([int(n) for n in args.tensors.split(",")], [g == "on" for g in args.gc.split(",")],
               period=args.ticker, part_size=args.part_size)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
