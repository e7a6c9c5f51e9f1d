"""The file index's commit as the world grows: R synthetic ranks in one process, each marking one tier durable
(`mark_durable`) and polling it once as a waiting rank does (`tier_state` given its rank), one after the other,
against a real file index in a temporary folder; then every rank's last poll. Reports the process's CPU
seconds per world size, per rank, and the slope of CPU against R on a log-log fit (1: O(1) per rank; 2: each
rank's cost grows with the world). Judges nothing (docs/benchmarks.md, *File-index commit*).

    python -m tiered_ckpt.bench.file_commit [--ranks 64 256 1024 4096] [--limit 120]
"""
from __future__ import annotations

import argparse
import asyncio
import inspect
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

from ..storage.index.file import FileIndex


async def commit(root: Path, ranks: int, step: int) -> dict[str, float]:
    """One tier's commit by `ranks` ranks: CPU seconds and wall seconds, checked to commit exactly once."""
    index = FileIndex(root)
    # a poll names its rank where the index takes it (an older release's does not: measured as it polled)
    by_rank = "rank" in inspect.signature(index.tier_state).parameters
    committed = 0
    cpu, wall = time.process_time(), time.perf_counter()
    for rank in range(ranks):
        committed += await index.mark_durable("bench", step, "disk", rank, ranks, "s")
        await index.tier_state("bench", step, "disk", "s", **({"rank": rank} if by_rank else {}))
    for rank in range(ranks):
        state = await index.tier_state("bench", step, "disk", "s", **({"rank": rank} if by_rank else {}))
        if state.state != "complete":
            raise AssertionError(f"rank {rank} sees the tier {state.state} after every marker")
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    if committed != 1:
        raise AssertionError(f"{committed} markers committed the tier (expected exactly one)")
    await index.close()
    return {"ranks": ranks, "cpu": cpu, "wall": wall}


def slope(rows: list[dict[str, float]]) -> float:
    """Least-squares slope of log(CPU) against log(R)."""
    xs, ys = [math.log(r["ranks"]) for r in rows], [math.log(max(r["cpu"], 1e-6)) for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tiered_ckpt.bench.file_commit", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024, 4096], help="world sizes")
    p.add_argument("--limit", type=float, default=120.0,
                   help="skip larger worlds once one took more CPU seconds than this (default 120)")
    p.add_argument("--dir", default=None, help="where the index's temporary folder goes (default: the system's)")
    args = p.parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="tiered_ckpt-file-commit-", dir=args.dir))
    rows: list[dict[str, float]] = []
    try:
        print(f"{'ranks':>6}  {'CPU s':>8}  {'wall s':>8}  {'CPU ms/rank':>11}", flush=True)
        for step, ranks in enumerate(sorted(args.ranks), 1):
            if rows and rows[-1]["cpu"] > args.limit:
                print(f"{ranks:>6}  skipped (the last world took {rows[-1]['cpu']:.0f} s > --limit)", flush=True)
                continue
            row = asyncio.run(commit(base / "index", ranks, step))
            rows.append(row)
            per_rank = 1000 * row["cpu"] / ranks
            print(f"{ranks:>6}  {row['cpu']:>8.2f}  {row['wall']:>8.2f}  {per_rank:>11.3f}", flush=True)
        if len(rows) > 1:
            print(f"slope of CPU against ranks (log-log): {slope(rows):.2f}")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
