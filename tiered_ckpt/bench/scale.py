"""`python -m tiered_ckpt.bench.scale`: one save and one resume's metadata work at 64 ... 10,240 synthetic ranks.

What cannot run here (thousands of ranks) is simulated through the project's own code in one process, the ranks
taking turns: each phase calls the real planner, index and catalog, and counts what a rank and the coordinator
pay. Phases, per world size R:

- **plan**: a plan miss (`plan_scale.measure`): one non-coordinator rank's CPU, the coordinator's CPU, the bytes
  gathered to the coordinator and the bytes one rank receives back; DDP and FSDP2-like layouts.
- **manifest**: rank 0 encodes the checkpoint's manifest from that plan (CPU, bytes).
- **commit**: every rank marks one tier durable and polls it as a waiting rank does, against a real
  `redis-server` and a file index: index round trips and CPU per rank; exactly one marker commits.
- **load metadata**: rank 0 reads the manifest and every rank's record (`Catalog.read_manifest`), then every
  other rank decodes what rank 0 hands on (`load/shared.py`): round trips, CPU, bytes.

Each series is fitted with the slope of log(cost) against log(R): 0 is flat, 1 linear. CPU is `process_time`
(threads included) on a machine that may be shared: single figures vary, slopes much less. Judges nothing;
docs/benchmarks.md (*Ten thousand ranks, simulated*) records a run.

    python -m tiered_ckpt.bench.scale [--ranks 64 256 1024 4096 10240] [--tensors 1000] [--json out.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from ..storage.index.file import FileIndex
from ..testing.counting import CountingIndex
from . import load_metadata, plan_scale

JOB = "scale"


def slope(xs: list[int], ys: list[float]) -> float | None:
    """Least-squares slope of log y against log x (None with fewer than two points or a zero cost)."""
    points = [(x, y) for x, y in zip(xs, ys) if y is not None and y > 0]
    if len(points) < 2:
        return None
    lx, ly = [math.log(x) for x, _ in points], [math.log(y) for _, y in points]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    den = sum((a - mx) ** 2 for a in lx)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / den if den else None


def plan_phase(layout: str, tensors: int, ranks: int) -> dict[str, Any]:
    """A plan miss at `ranks` ranks, through the project's planner (plan_scale.measure)."""
    m = plan_scale.measure(layout, tensors, ranks, manifest=True)
    # (an older plan_scale reports one figure: every rank planned the world, so a rank paid the coordinator's cost)
    rank_cpu = m.get("rank_cpu", m.get("cpu_s"))
    return {"phase": f"plan {layout}", "ranks": ranks, "rank_cpu": rank_cpu,
            "coordinator_cpu": m.get("coordinator_cpu", rank_cpu), "gathered_bytes": m.get("gathered_bytes"),
            "rank_received_bytes": m.get("rank_received_bytes"), "max_mean": m.get("max_mean"),
            "chunks": m.get("chunks"), "manifest_bytes": m.get("manifest_bytes"),
            "manifest_cpu": m.get("manifest_cpu")}


async def commit_phase(name: str, make: Callable[[], Any], ranks: int, step: int) -> dict[str, Any]:
    """Every rank marks one tier durable and polls it once, then polls again (the commit seen complete): round
    trips and CPU per rank. A fresh job per world, so earlier worlds' keys do not weigh on it."""
    index = make()
    await index.open()
    job = f"{JOB}-commit-{ranks}"
    index.epoch = await index.fence(job)
    await index.begin(job, step, ["disk"])
    counting = CountingIndex(index)
    committed = 0
    cpu = time.process_time()
    for rank in range(ranks):
        committed += await counting.mark_durable(job, step, "disk", rank, ranks, "s")
        await counting.tier_state(job, step, "disk", "s", rank=rank)
    for rank in range(ranks):
        state = await counting.tier_state(job, step, "disk", "s", rank=rank)
        if state.state != "complete":
            raise AssertionError(f"{name}: rank {rank} sees the tier {state.state} after every marker")
    cpu = time.process_time() - cpu
    await index.close()
    if committed != 1:
        raise AssertionError(f"{name}: {committed} markers committed the tier (expected exactly one)")
    return {"phase": f"commit {name}", "ranks": ranks, "rank_cpu": cpu / ranks,
            "round_trips_rank": counting.total / ranks, "round_trips_world": counting.total}


async def load_phase(name: str, make: Callable[[], Any], ranks: int) -> dict[str, Any]:
    """Rank 0 reads the manifest and every record; another rank decodes what rank 0 hands on."""
    index = make()
    await index.open()
    job = f"{JOB}-load-{ranks}"
    index.epoch = await index.fence(job)
    await load_metadata.write_checkpoint(index, ranks, job=job)
    manifest, trips, cpu, _ = await load_metadata.read_metadata(index, job=job)
    await index.close()
    encode, decode, sent = load_metadata._handed_on(manifest)
    return {"phase": f"load metadata {name}", "ranks": ranks, "coordinator_cpu": cpu + (encode or 0.0),
            "rank_cpu": decode, "round_trips_world": trips, "round_trips_rank": 0 if encode is not None else trips,
            "rank_received_bytes": sent}


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4f}" if value < 1 else f"{value:.2f}"
    return f"{value:,}"


COLUMNS = ("rank_cpu", "coordinator_cpu", "round_trips_rank", "round_trips_world", "gathered_bytes",
           "rank_received_bytes", "max_mean", "manifest_bytes", "manifest_cpu")


def report(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown: one row per (phase, R), then each phase's slopes."""
    lines = ["| phase | R | " + " | ".join(COLUMNS) + " |", "|---|---:|" + "---:|" * len(COLUMNS)]
    for row in rows:
        lines.append(f"| {row['phase']} | {row['ranks']:,} | " + " | ".join(_fmt(row.get(c)) for c in COLUMNS) + " |")
    lines.append("")
    for phase in dict.fromkeys(r["phase"] for r in rows):
        series = [r for r in rows if r["phase"] == phase]
        xs = [r["ranks"] for r in series]
        fits = []
        for column in COLUMNS:
            ys = [r.get(column) for r in series]
            if column != "max_mean" and all(isinstance(y, (int, float)) for y in ys):
                s = slope(xs, ys)
                if s is not None:
                    fits.append(f"{column} R^{s:.2f}")
        lines.append(f"- {phase}: " + (", ".join(fits) or "(one point)"))
    return lines


async def index_phases(sizes: list[int], redis_url: str | None) -> list[dict[str, Any]]:
    from ..storage.index.redis import RedisIndex
    from ..testing.redis_local import LocalServer

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as d, (LocalServer() if redis_url is None
                                              else load_metadata._Given(redis_url)) as server:
        makers = (("redis", lambda: RedisIndex(server.url, timeout=60)),
                  ("file", lambda: FileIndex(Path(d) / "index")))
        for name, make in makers:
            for step, ranks in enumerate(sizes, 1):
                rows.append(await commit_phase(name, make, ranks, step))
                print(f"  commit {name} R={ranks} done", flush=True)
        for name, make in makers:
            for ranks in sizes:
                rows.append(await load_phase(name, make, ranks))
                print(f"  load metadata {name} R={ranks} done", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tiered_ckpt.bench.scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024, 4096, 10240])
    p.add_argument("--tensors", type=int, default=1000, help="tensors a rank holds in the planning phase")
    p.add_argument("--layouts", default="ddp,fsdp")
    p.add_argument("--cap", type=float, default=60.0,
                   help="stop a planning series after a point over this many CPU seconds (larger worlds take longer)")
    p.add_argument("--skip", default="", help="phases to leave out: plan, index (comma-separated)")
    p.add_argument("--redis-url", help="a Redis to use instead of a local redis-server on a free port")
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)
    sizes = sorted(args.ranks)
    skip = set(filter(None, args.skip.split(",")))
    rows: list[dict[str, Any]] = []
    if "plan" not in skip:
        for layout in args.layouts.split(","):
            for ranks in sizes:
                row = plan_phase(layout, args.tensors, ranks)
                rows.append(row)
                print(f"  plan {layout} R={ranks} done", flush=True)
                if max(row["rank_cpu"] or 0, row["coordinator_cpu"] or 0) > args.cap:
                    break
    if "index" not in skip:
        rows += asyncio.run(index_phases(sizes, args.redis_url))
    print("\n".join(report(rows)))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
