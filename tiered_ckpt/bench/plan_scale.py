"""`python -m tiered_ckpt.bench.plan_scale`: the save planner at thousands of synthetic ranks, in one process.

A plan miss gathers every rank's descriptors (`Box`es, pickled by Planner._describe, through
all_gather_object) and every rank runs `build_plan` on all of them. This builds those gathered descriptors for
R ranks without a process group (each rank's own bytes: nothing shared between ranks) and times the project's
own `build_plan`, unpacking included, for one rank (every rank runs the same): CPU seconds, max/mean bytes per rank,
chunks in the plan, and the log-log slope of CPU against R. Layouts: `ddp` (every tensor replicated on every
rank) and `fsdp` (each tensor sharded along dim 0 over all ranks, FSDP2's torch.chunk split, empty shards at
the end). A series stops once a point takes more than --cap CPU seconds (its larger worlds would take longer).
"""
from __future__ import annotations

import argparse
import gc
import math
import pickle
import resource
import time
from typing import Any

from ..save.plan import Box, build_plan

COLS = 1024
DTYPE = "torch.float32"


def _rows(i: int) -> int:
    return 4096 + (i * 7919 % 8) * 1024  # 4,096 to 11,264 rows of 1,024 floats: 16 to 44 MiB a tensor


def _rank_boxes(layout: str, tensors: int, rank: int, world: int) -> list[Box]:
    boxes = []
    for i in range(tensors):
        rows = _rows(i)
        shape = (rows, COLS)
        if layout == "ddp":
            offsets, sizes = (0, 0), shape
        else:
            step = -(-rows // world)
            start = min(rank * step, rows)
            offsets, sizes = (start, 0), (min(step, rows - start), COLS)
        boxes.append(Box(f"model.layers.{i}.weight", DTYPE, 4, shape, offsets, sizes))
    return boxes


def gathered(layout: str, tensors: int, world: int, packed: bool = True) -> list[Any]:
    """What the plan's all_gather_object hands every rank: each rank's boxes pickled (Planner._describe packs
    them; build_plan unpacks those of each distinct rank), or with packed=False a list each, unpickled on its
    own (what the gather handed the planner before)."""
    if packed:
        return [pickle.dumps([tuple(b) for b in _rank_boxes(layout, tensors, r, world)],
                             protocol=pickle.HIGHEST_PROTOCOL) for r in range(world)]
    return [pickle.loads(pickle.dumps(_rank_boxes(layout, tensors, r, world))) for r in range(world)]


def measure(layout: str, tensors: int, world: int, packed: bool = True) -> dict[str, Any]:
    everyone = gathered(layout, tensors, world, packed)
    gc.collect()
    gc_was = gc.isenabled()
    gc.disable()  # as the engine plans (state/gc_pause.py)
    try:
        t = time.process_time()
        plan = build_plan(("bench",), everyone, 0, 64 << 20)
        cpu = time.process_time() - t
    finally:
        if gc_was:
            gc.enable()
    loads = plan.rank_nbytes
    out = {"layout": layout, "tensors": tensors, "ranks": world, "cpu_s": cpu,
           "max_mean": max(loads) / (sum(loads) / world), "chunks": sum(len(t.chunks) for t in plan.tensors),
           "maxrss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    del plan, everyone
    gc.collect()
    return out


def slope(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of log(cpu) against log(ranks)."""
    xs, ys = [math.log(r) for r, _ in points], [math.log(max(c, 1e-6)) for _, c in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="64,256,1024,4096,10240")
    ap.add_argument("--tensors", default="40,1000")
    ap.add_argument("--layouts", default="ddp,fsdp")
    ap.add_argument("--cap", type=float, default=60.0, help="stop a series after a point over this many CPU s")
    ap.add_argument("--unpacked", action="store_true", help="feed lists of boxes (as the gather did before)")
    args = ap.parse_args()
    print("| layout | tensors | ranks | CPU s (one rank) | max/mean bytes | chunks | peak RSS GiB |")
    print("|---|---|---|---|---|---|---|", flush=True)
    for layout in args.layouts.split(","):
        for tensors in map(int, args.tensors.split(",")):
            points = []
            for world in map(int, args.ranks.split(",")):
                m = measure(layout, tensors, world, not args.unpacked)
                points.append((world, m["cpu_s"]))
                print(f"| {layout} | {tensors} | {world} | {m['cpu_s']:.3f} | {m['max_mean']:.4f} | {m['chunks']} "
                      f"| {m['maxrss_gib']:.1f} |", flush=True)
                if m["cpu_s"] > args.cap:
                    break
            if len(points) > 1:
                print(f"| {layout} | {tensors} | slope | R^{slope(points):.2f} | | | |", flush=True)


if __name__ == "__main__":
    main()
