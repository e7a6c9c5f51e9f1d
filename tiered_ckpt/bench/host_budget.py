"""Host memory with and without `[engine] host_memory` (#30 item 2): what a job holds in RAM while it saves.

`python -m tiered_ckpt.bench.host_budget [--size 256MiB] [--saves 8] [--keep-last 4]` (or `tiered-ckpt bench
--host-budget`): in a fresh process per run, a memory tier (keep_last 4) and a disk tier, a state of --size,
`--saves` saves one after the other, each waited for. A thread samples every 2 ms the process's anonymous RSS
(`RssAnon` of /proc/self/status: staging, read buffers, torch's allocations) and the bytes of the memory tier's
folder in the tmpfs (its checkpoints and staging files: RAM too, whether mapped or not); the peak of their sum
above the state itself is what checkpointing held. Runs: no budget, and a budget that holds two checkpoints
(keep_last must give way to 2). One JSON line per run with --json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from ..sizes import format_size, parse_size


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def _folder_bytes(root: Path) -> int:
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            try:
                total += os.stat(os.path.join(folder, name)).st_blocks * 512
            except FileNotFoundError:
                pass  # retired meanwhile
    return total


def measure_one(nbytes: int, saves: int, keep_last: int, budget: int | None, shm: Path, disk: Path) -> dict[str, Any]:
    """One run in this process (call it in a fresh one): the peak of anonymous RSS + the memory tier's tmpfs
    bytes above what the process held once the state existed."""
    import tiered_ckpt as tc
    from tiered_ckpt.config import parse_config

    from .measure import mixed_state, state_nbytes

    state = mixed_state(nbytes)
    for t in state.values():
        t.add_(0)  # touched: its pages are in the baseline, not in what checkpointing holds
    engine: dict[str, Any] = {"job": "hostbudget", "index": f"file://{disk}/index", "part_size": "64MiB"}
    if budget is not None:
        engine["host_memory"] = budget
    config = parse_config({"engine": engine, "tiers": [
        {"name": "host", "kind": "memory", "path": str(shm), "keep_last": keep_last},
        {"name": "disk", "kind": "local", "path": str(disk / "parts"), "keep_last": 1}]})
    baseline = _rss_anon() + _folder_bytes(shm)
    peak, stop = [baseline], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_anon() + _folder_bytes(shm))
            time.sleep(0.002)

    async def run() -> dict[str, Any]:
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        async with tc.Engine(config) as e:
            for step in range(1, saves + 1):
                for t in state.values():
                    t.add_(1)
                await (await e.save(step, state)).wait()
            in_memory = [s.step for s in await e.statuses() if "host" in s.complete]
            held = _folder_bytes(shm)
        stop.set()
        sampler.join()
        return {"state_bytes": state_nbytes(state), "budget": budget, "keep_last": keep_last,
                "kept_in_memory": in_memory, "peak_extra_bytes": peak[0] - baseline, "tier_bytes_at_end": held}

    return asyncio.run(run())


def run(nbytes: int, saves: int, keep_last: int, shm_root: str) -> list[dict[str, Any]]:
    """Both runs, each in a fresh process: no budget, and a budget for two checkpoints beside staging and reads."""
    part = min(64 << 20, nbytes)
    two = 4 * nbytes + 4 * part + nbytes // 16  # 1 staging + 2 kept + 1 retiring, 4 read buffers, alignment slack
    out = []
    for budget in (None, two):
        with tempfile.TemporaryDirectory(dir=shm_root) as shm, tempfile.TemporaryDirectory() as disk:
            argv = [sys.executable, "-m", "tiered_ckpt.bench.host_budget", "--one", str(nbytes), str(saves),
                    str(keep_last), str(budget or 0), shm, disk]
            done = subprocess.run(argv, capture_output=True, text=True, check=True)
            out.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return out


def report(runs: list[dict[str, Any]]) -> str:
    lines = ["| host_memory | memory tier keeps | peak extra host memory (anon RSS + tmpfs) | within budget |",
             "|---|---|---:|---|"]
    for r in runs:
        budget = "unset" if r["budget"] is None else format_size(r["budget"])
        within = "-" if r["budget"] is None else ("yes" if r["peak_extra_bytes"] <= r["budget"] else "no")
        lines.append(f"| {budget} | {len(r['kept_in_memory'])} checkpoints, steps {r['kept_in_memory']} (keep_last "
                     f"{r['keep_last']} configured) | "
                     f"{format_size(r['peak_extra_bytes'])} ({r['peak_extra_bytes'] / r['state_bytes']:.2f} states) "
                     f"| {within} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tiered_ckpt.bench.host_budget")
    p.add_argument("--size", default="256MiB")
    p.add_argument("--saves", type=int, default=8)
    p.add_argument("--keep-last", type=int, default=4)
    p.add_argument("--shm", default="/dev/shm")
    p.add_argument("--json", action="store_true")
    p.add_argument("--one", nargs=6, help=argparse.SUPPRESS)  # a run in this process (run() starts these)
    args = p.parse_args(argv)
    if args.one:
        nbytes, saves, keep, budget, shm, disk = args.one
        print(json.dumps(measure_one(int(nbytes), int(saves), int(keep), int(budget) or None, Path(shm), Path(disk))))
        return 0
    runs = run(parse_size(args.size), args.saves, args.keep_last, args.shm)
    print("\n".join(json.dumps(r) for r in runs) if args.json else report(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
