"""`python -m tiered_ckpt.bench.plan_scale`: the save planner at thousands of synthetic ranks, in one process.

A plan miss sends every rank's descriptors to rank 0 (describe.py, through gather_object), which plans the world
once (world_plan.py) and sends each rank its share (scatter_object_list). This builds every rank's descriptors
for R ranks without a process group and times, in CPU seconds, each side of that protocol with the project's own
code: a rank other than the coordinator (encoding its descriptors, pickling them as gather_object does, unpickling
its share and making its LocalCopies), and the coordinator (the same for itself, unpickling every rank's
payload, planning the world, pickling every rank's share as scatter_object_list does). Also: the bytes gathered
to the coordinator (pickled payloads; gloo pads each to the largest) and sent to one rank, max/mean bytes per
rank, chunks in the manifest's table, and the log-log slopes of CPU against R. Layouts: `ddp` (every tensor
replicated on every rank), `fsdp` (each tensor sharded along dim 0 over all ranks, FSDP2's torch.chunk split,
empty shards at the end) and `hsdp` (two replicas of an FSDP over half the ranks). A series stops once a point
takes more than --cap CPU seconds (its larger worlds would take longer).
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import math
import pickle
import resource
from typing import Any, Callable

import numpy as np

from ..save.describe import DIGEST, describe, pack_ints
from ..save.plan import Box, _warn_if_replicas_differ
from ..manifest import Manifest, RankMeta
from ..save.world_plan import WorldPlan, plan_world

COLS = 1024
DTYPE = "torch.float32"


def _rows(i: int) -> int:
    return 4096 + (i * 7919 % 8) * 1024  # 4,096 to 11,264 rows of 1,024 floats: 16 to 44 MiB a tensor


LAYOUTS = ("ddp", "fsdp", "hsdp")


def rank_boxes(layout: str, tensors: int, rank: int, world: int) -> list[Box]:
    """One rank's descriptors, as Planner._describe makes them from its tensors."""
    boxes = []
    shards, shard = (world // 2, rank % (world // 2)) if layout == "hsdp" else (world, rank)
    for i in range(tensors):
        rows = _rows(i)
        shape = (rows, COLS)
        if layout == "ddp":
            offsets, sizes = (0, 0), shape
        else:
            step = -(-rows // shards)
            start = min(shard * step, rows)
            offsets, sizes = (start, 0), (min(step, rows - start), COLS)
        boxes.append(Box(f"model.layers.{i}.weight", DTYPE, 4, shape, offsets, sizes, layout == "fsdp"))
    return boxes


def _payload(layout: str, tensors: int, rank: int, world: int, first: tuple[bytes, bytes]) -> tuple[Any, ...]:
    """What describe() makes of rank_boxes(...) for a rank whose structure is rank 0's, made with array work (the
    bench's set-up for R ranks; describe() itself is timed on ranks 0 and 1, and checked to agree with this)."""
    rows = np.asarray([_rows(i) for i in range(tensors)], dtype=np.int64)
    cols = np.full(tensors, COLS, dtype=np.int64)
    if layout == "ddp":
        offsets, sizes = np.zeros((tensors, 2), np.int64), np.stack([rows, cols], axis=1)
    else:
        shards, shard = (world // 2, rank % (world // 2)) if layout == "hsdp" else (world, rank)
        step = -(-rows // shards)
        start = np.minimum(shard * step, rows)
        offsets = np.stack([start, np.zeros(tensors, np.int64)], axis=1)
        sizes = np.stack([np.minimum(step, rows - start), cols], axis=1)
    alone = np.full(tensors, int(layout == "fsdp"), np.int64)
    boxes = pack_ints(np.concatenate([[2], offsets.ravel(), sizes.ravel(), alone]))
    same = hashlib.blake2b(boxes, digest_size=DIGEST).digest() == first[1]
    return (first[0], None, None if same else boxes, b"", b"")


def world_plan(layout: str, tensors: int, world: int) -> WorldPlan:
    """The plan the coordinator makes for a world of `world` synthetic ranks of this layout (its `tensors` table is
    the manifest's): what another bench needs of a checkpoint of that size."""
    first = describe(rank_boxes(layout, tensors, 0, world), 0)
    return plan_world([first.payload_for(None)] + [_payload(layout, tensors, r, world, first.digest)
                                                   for r in range(1, world)])


def _cpu(fn: Callable[[], Any]) -> tuple[Any, float]:
    out, user, system, _ = _cpu_split(fn)
    return out, user + system


def _cpu_split(fn: Callable[[], Any]) -> tuple[Any, float, float, int]:
    """fn(), its user and system CPU seconds and the page faults it took. The system part is mostly the first
    touch of fresh memory: on a VM whose host backs guest memory lazily it is most of the plan's CPU at millions
    of chunks (docs/benchmarks.md), where bare metal pays a small fraction of it."""
    gc.collect()
    gc_was = gc.isenabled()
    gc.disable()  # as the engine plans (state/gc_pause.py)
    try:
        before = resource.getrusage(resource.RUSAGE_SELF)
        out = fn()
        after = resource.getrusage(resource.RUSAGE_SELF)
        return (out, after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime,
                after.ru_minflt - before.ru_minflt)
    finally:
        if gc_was:
            gc.enable()


def measure(layout: str, tensors: int, world: int, *, manifest: bool = False, load: bool = False) -> dict[str, Any]:
    """One point: CPU seconds of rank 1 ("rank_cpu") and of rank 0 ("coordinator_cpu"), bytes gathered to rank 0
    and received by rank 1, max/mean bytes per rank, chunks in the world's table; with `manifest`, also rank 0's
    CPU to encode the checkpoint's manifest from that table and its size ("manifest_cpu", "manifest_bytes"); with
    `load`, a loading rank's (rank 1, same layout) metadata work after rank 0 read the checkpoint: decoding the
    manifest rank 0 sent ("load_decode_cpu") and planning its reads ("load_plan_cpu"), the saved chunks it
    reads ("load_chunks"), and under `fsdp` and `ddp` every rank's plan of the load's broadcasts ("load_broadcast_cpu")."""
    described0, _ = _cpu(lambda: describe(rank_boxes(layout, tensors, 0, world), 0))
    first = described0.digest
    gathered = [pickle.dumps(described0.payload_for(None), protocol=pickle.HIGHEST_PROTOCOL)]
    for r in range(1, world):  # what gather_object hands rank 0: each rank's payload pickled
        if r == 1:
            boxes = rank_boxes(layout, tensors, 1, world)
            (described1, sent), encode_cpu = _cpu(lambda: _encode(boxes, 1, first))
            gathered.append(sent)
            assert described1.payload_for(first) == _payload(layout, tensors, 1, world, first)
        else:
            gathered.append(pickle.dumps(_payload(layout, tensors, r, world, first), protocol=pickle.HIGHEST_PROTOCOL))

    def coordinate() -> tuple[Any, list[bytes]]:
        mine = describe(rank_boxes(layout, tensors, 0, world), 0)  # (its own boxes made here: cheap next to these)
        payloads = [mine.payload_for(None)] + [pickle.loads(b) for b in gathered[1:]]  # (rank 0 keeps its own)
        _warn_if_replicas_differ([p[4] for p in payloads])
        plan = plan_world(payloads)
        total, largest = sum(plan.rank_nbytes), max(plan.rank_nbytes)
        sent = [pickle.dumps(("plan", n, total, largest, s), protocol=pickle.HIGHEST_PROTOCOL)
                for n, s in zip(plan.rank_nbytes, plan.shares)]
        mine.local(plan.shares[0])
        return plan, sent

    (plan, sent), coordinator_user, coordinator_sys, coordinator_faults = _cpu_split(coordinate)
    coordinator_cpu = coordinator_user + coordinator_sys
    reply = sent[1] if world > 1 else sent[0]
    local, receive_cpu = _cpu(lambda: described1.local(pickle.loads(reply)[4]) if world > 1 else None)
    loads = plan.rank_nbytes
    encoded = _manifest(plan) if manifest else {}
    if load:
        encoded.update(_load(plan, layout, tensors, world))
    out = {**encoded, "layout": layout, "tensors": tensors, "ranks": world,
           "rank_cpu": (encode_cpu + receive_cpu) if world > 1 else coordinator_cpu,
           "coordinator_cpu": coordinator_cpu, "coordinator_user": coordinator_user,
           "coordinator_sys": coordinator_sys, "coordinator_faults": coordinator_faults,
           "gathered_bytes": sum(len(b) for b in gathered[1:]),  # (rank 0 keeps its own: see Planner._exchange)
           "gathered_padded_bytes": world * max(map(len, gathered[1:]), default=0),
           "rank_received_bytes": len(reply), "max_mean": max(loads) / (sum(loads) / world),
           "chunks": len(plan.tensors.rank), "maxrss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    del plan, sent, local
    gc.collect()
    return out


def _manifest(plan: WorldPlan) -> dict[str, Any]:
    """Rank 0's encoding of the manifest of a save with this plan (records.py does the same, in a thread)."""
    m = Manifest(job="bench", step=1, world_size=len(plan.rank_nbytes), part_size=64 << 20, checksum="crc32c",
                 tensors=plan.tensors, ranks=tuple(RankMeta(r, n) for r, n in enumerate(plan.rank_nbytes)),
                 skeleton=b"", created=0.0)
    data, cpu = _cpu(m.to_bytes)
    return {"manifest_bytes": len(data), "manifest_cpu": cpu}


def _load(plan: WorldPlan, layout: str, tensors: int, world: int) -> dict[str, Any]:
    """Rank 1's side of a load of this plan's checkpoint into the same layout: the manifest's bytes decoded, then
    its read plan (load/reads.py) for its own boxes (tensors that are never touched: only their places count)."""
    import torch

    from ..load.reads import Boxed, plan_reads

    m = Manifest(job="bench", step=1, world_size=len(plan.rank_nbytes), part_size=64 << 20, checksum="crc32c",
                 tensors=plan.tensors, ranks=tuple(RankMeta(r, n) for r, n in enumerate(plan.rank_nbytes)),
                 skeleton=b"", created=0.0)
    data = m.to_bytes()
    decoded, decode_cpu = _cpu(lambda: Manifest.from_bytes(data, source="bench"))
    index = {p: i for i, p in enumerate(decoded.tensors.paths)}
    rank = 1 if world > 1 else 0
    targets = {index[b.path]: (b.path, Boxed(torch.empty(b.sizes), tuple(b.offsets)))  # (untouched: no memory)
               for b in rank_boxes(layout, tensors, rank, world) if 0 not in b.sizes}
    reads, plan_cpu = _cpu(lambda: plan_reads(decoded, targets))
    _, reencode_cpu = _cpu(decoded.to_bytes)  # (rank 0 encodes the manifest it read again, to hand it on)
    out = {"load_decode_cpu": decode_cpu, "load_plan_cpu": plan_cpu, "load_chunks": len(reads.dests) + len(reads.subs),
           "load_broadcast_cpu": None, "load_reencode_cpu": reencode_cpu}
    if layout in ("fsdp", "ddp"):  # 8 ranks a node hold their own parts in memory and on disk
        from ..load.broadcast import plan_broadcasts

        parts = [-(-n // m.part_size) for n in plan.rank_nbytes]
        if layout == "fsdp":  # each rank wants its own saved rank's parts
            wanted = [[((r, p), m.part_length(r, p)) for p in range(parts[r])] for r in range(world)]
        else:  # every rank wants every part: rank 0's list, which the others matched (read_with_broadcast)
            wanted = [[((r, p), m.part_length(r, p)) for r in range(world) for p in range(parts[r])]] * world
        node = [frozenset(range(r // 8 * 8, min(world, r // 8 * 8 + 8))) for r in range(world)]
        holdings = [{"memory": node[r], "disk": node[r]} for r in range(world)]
        _, out["load_broadcast_cpu"] = _cpu(lambda: plan_broadcasts(wanted, holdings, ["memory", "disk", "s3"]))
    return out


def _encode(boxes: list[Box], rank: int, first: tuple[bytes, bytes]) -> tuple[Any, bytes]:
    described = describe(boxes, rank)
    return described, pickle.dumps(described.payload_for(first), protocol=pickle.HIGHEST_PROTOCOL)


def slope(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of log(y) against log(ranks)."""
    xs, ys = [math.log(r) for r, _ in points], [math.log(max(c, 1e-6)) for _, c in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="64,256,1024,4096,10240")
    ap.add_argument("--tensors", default="40,1000")
    ap.add_argument("--layouts", default="ddp,fsdp")
    ap.add_argument("--cap", type=float, default=60.0, help="stop a series after a point over this many CPU s (the "
                    "coordinator's; with --load, a loading rank's decode and read plan)")
    ap.add_argument("--load", action="store_true",
                    help="instead: a loading rank's metadata CPU (manifest decode, read plan) against R")
    args = ap.parse_args()
    unknown = set(args.layouts.split(",")) - set(LAYOUTS)
    if unknown:  # (any other name planned sharded boxes not flagged alone: a layout no real state makes)
        ap.error(f"--layouts: unknown {', '.join(sorted(unknown))}; choose from {', '.join(LAYOUTS)}")
    if args.load:
        _main_load(args)
        return
    print("| layout | tensors | ranks | rank CPU s | coordinator CPU s (user + system) | page faults | gathered MB "
          "| to a rank KB | max/mean | chunks | peak RSS GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for layout in args.layouts.split(","):
        for tensors in map(int, args.tensors.split(",")):
            points = []
            for world in map(int, args.ranks.split(",")):
                m = measure(layout, tensors, world)
                points.append(m)
                print(f"| {layout} | {tensors} | {world} | {m['rank_cpu']:.4f} | {m['coordinator_cpu']:.3f} "
                      f"({m['coordinator_user']:.3f} + {m['coordinator_sys']:.3f}) | {m['coordinator_faults']} "
                      f"| {m['gathered_bytes'] / 1e6:.2f} | {m['rank_received_bytes'] / 1e3:.1f} "
                      f"| {m['max_mean']:.4f} | {m['chunks']} | {m['maxrss_gib']:.1f} |", flush=True)
                if m["coordinator_cpu"] > args.cap:
                    break
            if len(points) > 1:
                fit = {k: slope([(p["ranks"], p[k]) for p in points])
                       for k in ("rank_cpu", "coordinator_cpu", "coordinator_user", "gathered_bytes")}
                print(f"| {layout} | {tensors} | slope | R^{fit['rank_cpu']:.2f} | R^{fit['coordinator_cpu']:.2f} "
                      f"(user R^{fit['coordinator_user']:.2f}) | | R^{fit['gathered_bytes']:.2f} | | | | |", flush=True)


def _main_load(args: argparse.Namespace) -> None:
    print("| layout | tensors | ranks | manifest MB | save: rank 0 encodes it, CPU s | load: rank 0 encodes it again "
          "| rank 1: decode CPU s | rank 1: read plan CPU s | chunks it reads | a rank: broadcast plan CPU s |")
    print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for layout in args.layouts.split(","):
        for tensors in map(int, args.tensors.split(",")):
            points = []
            for world in map(int, args.ranks.split(",")):
                m = measure(layout, tensors, world, manifest=True, load=True)
                points.append(m)
                print(f"| {layout} | {tensors} | {world} | {m['manifest_bytes'] / 1e6:.1f} | {m['manifest_cpu']:.3f} "
                      f"| {m['load_reencode_cpu']:.3f} | {m['load_decode_cpu']:.3f} "
                      f"| {m['load_plan_cpu']:.3f} | {m['load_chunks']} | "
                      + ("" if m["load_broadcast_cpu"] is None else f"{m['load_broadcast_cpu']:.3f}") + " |", flush=True)
                if m["load_decode_cpu"] + m["load_plan_cpu"] > args.cap:  # (as the planning series stops)
                    break
            if len(points) > 1:
                fit = {k: slope([(p["ranks"], p[k]) for p in points]) for k in ("load_decode_cpu", "load_plan_cpu")}
                print(f"| {layout} | {tensors} | slope | | | | R^{fit['load_decode_cpu']:.2f} | R^{fit['load_plan_cpu']:.2f} "
                      f"| | |", flush=True)


if __name__ == "__main__":
    main()
