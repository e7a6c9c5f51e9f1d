"""`tiered-ckpt bench`: one process, one state, tiered_ckpt and every baseline in the same run."""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import uvloop

from .. import Engine
from ..save.plan import Planner
from ..sizes import format_size, parse_size
from . import MET_LEGEND, baselines, peers
from .measure import PeakRSS, drop_cache, engine_config, mixed_state, state_nbytes


SMALL_TENSORS = 100_000  # the many-tensor section of the full run (docs/benchmarks.md, *Many small tensors*)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", default=None,
                   help="state size (default 1GiB of mixed tensor sizes; with --peers, sizes, default 100MiB,1GiB)")
    p.add_argument("--dir", default=None, help="disk directory (default: a temp dir under ./.bench)")
    p.add_argument("--shm", default="/dev/shm", help="memory-tier directory (default /dev/shm)")
    p.add_argument("--part-size", default="64MiB")
    p.add_argument("--repeats", type=int, default=None,
                   help="median of this many runs per figure (default 3; with --peers, fresh processes: 2)")
    p.add_argument("--no-dcp", action="store_true", help="skip the DCP baselines")
    p.add_argument("--json", help="also write the raw figures here")
    p.add_argument("--redis", default="auto",
                   help="Redis URL for the Redis-tier comparison; 'auto' starts a local redis-server if one is "
                        "installed; 'off' skips it")
    p.add_argument("--s3", default="auto",
                   help="S3 endpoint URL for the S3-tier comparison (credentials from the AWS chain); 'auto' "
                        "starts a local moto_server if installed; 'off' skips it")
    p.add_argument("--s3-size", default="64MiB", help="bytes moved in the S3 comparison (moto is slow)")
    p.add_argument("--small-tensors", type=int, default=None, metavar="N",
                   help=f"also save and load a state of N 16-float tensors (0 skips it; default: {SMALL_TENSORS:,} "
                        f"without --size, the full run; none with --size)")
    p.add_argument("--nproc", type=int, default=1,
                   help="with N > 1: N local ranks holding a replicated state, tiered_ckpt beside DCP")
    p.add_argument("--index-storm", metavar="N[,N...]",
                   help="only the Redis index commit storm of N simulated ranks (e.g. 1024,4096), against a local "
                        "redis-server and a local 3-master cluster, or --redis URL (bench/index_storm.py)")
    p.add_argument("--peers", action="store_true",
                   help="only tiered_ckpt beside torch.save, DCP async_save, torch_checkpointing, torchsnapshot and "
                        "dlrover, each in fresh processes: the second save of a process (bench/peers.py)")
    peers.add_arguments(p)
    p.add_argument("--reshard", action="store_true",
                   help="only multi-rank loads that change the layout (FSDP2 2 -> 4, FSDP2 x TP 2x2 -> FSDP2 4), "
                        "tiered_ckpt beside DCP, in fresh processes: 8 MLP blocks of width 256 with AdamW, 48 MiB "
                        "(bench/reshard.py; python -m tiered_ckpt.bench.reshard WIDTH BLOCKS REPEATS for other sizes)")
    p.add_argument("--host-budget", action="store_true",
                   help="only host memory held while saving, with and without [engine] host_memory, each in a fresh "
                        "process: a memory tier with keep_last 4 and a budget for two checkpoints (bench/host_budget.py; "
                        "--size, default 256MiB)")
    p.add_argument("--training-loop", action="store_true",
                   help="only what checkpointing takes from a training loop: a ~2.2M-parameter GPT trained with no "
                        "checkpoint, with lazy saves every 3 steps, with DCP saving synchronously, and with 10 ms of "
                        "background Python at each save point as a yardstick; the saves' cost split per save "
                        "(bench/loop_share.py)")


def small_tensors(args: argparse.Namespace) -> int:
    """How many tensors the many-tensor section saves (0: skipped). It takes most of a run at a small --size
    (100,000 tensors: over a minute on 2 cores), so it runs with the default size or when asked for."""
    if args.small_tensors is not None:
        return args.small_tensors
    return SMALL_TENSORS if args.size is None else 0


def run_bench(args: argparse.Namespace) -> int:
    if args.index_storm:
        from .index_storm import run_cli

        urls = [args.redis] if args.redis not in ("auto", "off") else []
        return run_cli([int(n) for n in args.index_storm.split(",")], urls, 64, 10_000)
    if args.reshard:
        from .reshard import run_reshard_bench

        base = Path(args.dir or ".bench")
        base.mkdir(parents=True, exist_ok=True)
        print(run_reshard_bench(256, 8, base.resolve()))
        return 0
    if args.host_budget:
        from . import host_budget

        print(host_budget.report(host_budget.run(parse_size(args.size or "256MiB"), 8, 4, args.shm)))
        return 0
    if args.training_loop:
        from . import loop_share

        print(loop_share.report(loop_share.measure(repeats=args.repeats or 3, base=Path(args.dir or ".bench"),
                                                   shm=args.shm, dcp=not args.no_dcp)))
        return 0
    if args.peers:
        return peers.run_cli([parse_size(s) for s in (args.size or "100MiB,1GiB").split(",")], args.repeats or 2,
                             args.libraries.split(","), args.first_saves, Path(args.dir or ".bench"),
                             Path(args.shm), args.json)
    many = small_tensors(args)
    args.size, args.repeats = args.size or "1GiB", args.repeats or 3
    nbytes = parse_size(args.size)
    base = Path(args.dir) if args.dir else Path(".bench")
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="run-", dir=base))
    shm = Path(tempfile.mkdtemp(prefix="tiered_ckpt-bench-", dir=args.shm))
    try:
        state = mixed_state(nbytes)
        results = measure_all(state, work, shm, parse_size(args.part_size), args.repeats, not args.no_dcp)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    print(report(results))
    if not many:
        print("\n(the many-tensor section was skipped: it runs without --size, or with --small-tensors N)")
    else:
        from .small import measure_small, report_small

        work = Path(tempfile.mkdtemp(prefix="small-", dir=base))
        shm = Path(tempfile.mkdtemp(prefix="tiered_ckpt-bench-small-", dir=args.shm))
        try:
            small = [uvloop.run(measure_small(many, work / name, shm / name, automatic_gc=on))
                     for name, on in (("gc-on", True), ("gc-off", False))]
        finally:
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(shm, ignore_errors=True)
        results["small_tensors"] = small
        print()
        print(report_small(small))
    if args.redis != "off" and (args.redis != "auto" or shutil.which("redis-server")):
        from .redis_bench import LocalRedis, measure_redis, report_redis

        total, part = min(nbytes, 1 << 30), min(parse_size(args.part_size), nbytes)
        print()
        if args.redis == "auto":
            with LocalRedis() as url:
                print(report_redis(uvloop.run(measure_redis(url, total, part, 8))))
        else:
            print(report_redis(uvloop.run(measure_redis(args.redis, total, part, 8))))
    if args.s3 != "off":
        from . import s3_bench

        if args.s3 != "auto" or s3_bench.available():
            size = parse_size(args.s3_size)
            obj, multipart = min(16 << 20, size), min(8 << 20, size)
            multipart = max(multipart, 5 << 20)
            print()
            if args.s3 == "auto":
                with s3_bench.LocalS3() as url:
                    print(s3_bench.report_s3(uvloop.run(s3_bench.measure_s3(url, size, obj, multipart, 8)),
                                             "a local moto_server"))
            else:
                print(s3_bench.report_s3(uvloop.run(s3_bench.measure_s3(args.s3, size, obj, multipart, 8)), args.s3))
    if args.nproc > 1:  # the same table, plus the multi-rank comparison
        from .dist_bench import run_dist_bench

        print()
        print(run_dist_bench(args.nproc, nbytes, parse_size(args.part_size), args.repeats, base, Path(args.shm)))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def measure_all(state: dict[str, torch.Tensor], work: Path, shm: Path, part_size: int, repeats: int,
                dcp: bool) -> dict[str, Any]:
    r: dict[str, Any] = {"bytes": state_nbytes(state), "tensors": len(state), "repeats": repeats,
                         "torch": torch.__version__, "python": platform.python_version(), "cuda": torch.cuda.is_available()}
    log = lambda what: print(f"  measuring {what} ...", file=sys.stderr, flush=True)  # noqa: E731
    log("memcpy")
    r["memcpy"] = baselines.memcpy(state, repeats)
    log("raw disk write+fsync / cold read")
    r["raw_write"], r["raw_read"] = baselines.raw_write_read(work, r["bytes"], repeats)
    log("torch.save+fsync / torch.load")
    r["torch_save"], r["torch_load"] = baselines.torch_save_load(state, work, repeats)
    if dcp:
        log("DCP save / async_save / load")
        r.update(baselines.dcp_all(state, work, repeats))
    log("tiered_ckpt")
    r.update(uvloop.run(measure_tiered(state, work / "tiered", shm, part_size, repeats)))
    return r


def _spread(ratios: list[float]) -> dict[str, float]:
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


async def measure_tiered(state: dict[str, torch.Tensor], disk: Path, shm: Path, part_size: int,
                         repeats: int) -> dict[str, Any]:
    """tiered_ckpt's figures, each paired with its baseline measured right before it (A B A B ...), so a
    ratio compares two runs under the same machine conditions; `pairs` holds the median and spread of the
    per-pair ratios (the machine's noise moves both sides of a pair together)."""
    nbytes = state_nbytes(state)
    config = engine_config(disk, shm, part_size, nbytes)
    raw_dir = disk / "raw"
    raw_dir.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {}
    planner = Planner(part_size)
    paths, tensors = list(state), list(state.values())
    t = time.perf_counter()
    await planner.plan(paths, tensors)
    out["plan_miss"] = time.perf_counter() - t
    t = time.perf_counter()
    await planner.plan(paths, tensors)
    out["plan_hit"] = time.perf_counter() - t

    pairs: dict[str, list[float]] = {k: [] for k in PAIRS}
    step = 0
    async with Engine(config) as engine:
        with PeakRSS() as rss:  # the first save until durable, with the next staging buffer it prepares
            t = time.perf_counter()
            handle = await engine.save(step, state)
            out["first_save_blocking"] = time.perf_counter() - t
            await handle.wait()
            await engine.wait_all()
        for _ in range(2):  # the memory tier keeps one checkpoint: its buffer and the next one exist after these
            step += 1
            await (await engine.save(step, state)).wait()
            await engine.wait_all()
        blocking, durable_host, durable_disk, lazy_return, lazy_staged = [], [], [], [], []
        for _ in range(repeats):
            copy = baselines.memcpy(state, 1)
            step += 1
            t = time.perf_counter()
            handle = await engine.save(step, state)
            blocking.append(time.perf_counter() - t)
            await handle.wait()
            durable_host.append(handle.durable_at["host"])
            durable_disk.append(handle.durable_at["disk"])
            await engine.wait_all()
            write = baselines.raw_write_once(raw_dir, nbytes)
            pairs["save blocking / memcpy"].append(blocking[-1] / copy)
            pairs["durable on memory tier / memcpy"].append(durable_host[-1] / copy)
            pairs["disk: durable bandwidth / raw write bandwidth"].append(write / durable_disk[-1])
        step += 1
        with PeakRSS() as steady_rss:  # a later save (untimed: the sampling thread takes CPU)
            await (await engine.save(step, state)).wait()
            await engine.wait_all()
        for _ in range(repeats):
            step += 1
            t = time.perf_counter()
            handle = await engine.save(step, state, lazy=True)
            lazy_return.append(time.perf_counter() - t)
            await handle.staged()
            lazy_staged.append(time.perf_counter() - t)
            await handle.wait()
            await engine.wait_all()
    out["peak_extra_rss"] = rss.extra
    out["steady_extra_rss"] = steady_rss.extra
    async with Engine(config) as engine:
        target = {k: torch.zeros_like(v) for k, v in state.items()}  # touched, as a live model's tensors are
        load_host, load_disk = [], []
        for _ in range(repeats):
            copy = baselines.memcpy(state, 1)
            t = time.perf_counter()
            info = await engine.load(target, tiers=["host"])
            load_host.append(time.perf_counter() - t)
            assert info.tier == "host" and not info.fallbacks
            pairs["load from memory tier / memcpy"].append(load_host[-1] / copy)
        for _ in range(repeats):
            read = baselines.raw_read_once(raw_dir, nbytes)
            drop_cache(disk / "parts")
            t = time.perf_counter()
            info = await engine.load(target, tiers=["disk"])
            load_disk.append(time.perf_counter() - t)
            assert info.tier == "disk" and not info.fallbacks
            pairs["disk: load bandwidth / raw cold read bandwidth"].append(read / load_disk[-1])
        if not all(torch.equal(target[k], state[k]) for k in state):
            raise AssertionError("benchmark load did not reproduce the saved state")
    shutil.rmtree(raw_dir, ignore_errors=True)
    out["pairs"] = {k: _spread(v) for k, v in pairs.items()}
    out["memory_only"] = await measure_memory_only(state, disk / "memory-only", shm, part_size, repeats)
    med = statistics.median
    out.update(save_blocking=med(blocking), durable_host=med(durable_host), durable_disk=med(durable_disk),
               lazy_return=med(lazy_return), lazy_staged=med(lazy_staged), load_host=med(load_host),
               load_disk=med(load_disk))
    return out


PAIRS = ("save blocking / memcpy", "durable on memory tier / memcpy", "load from memory tier / memcpy",
         "disk: durable bandwidth / raw write bandwidth", "disk: load bandwidth / raw cold read bandwidth")
PAIR_TARGETS = {"save blocking / memcpy": ("≤ 1.1", lambda x: x <= 1.1),
                "durable on memory tier / memcpy": ("≤ 1.2", lambda x: x <= 1.2),
                "load from memory tier / memcpy": ("≤ 1.5", lambda x: x <= 1.5),
                "disk: durable bandwidth / raw write bandwidth": ("≥ 0.95", lambda x: x >= 0.95),
                "disk: load bandwidth / raw cold read bandwidth": ("≥ 0.8", lambda x: x >= 0.8)}


async def measure_memory_only(state: dict[str, torch.Tensor], disk: Path, shm: Path, part_size: int,
                              repeats: int) -> dict[str, dict[str, float]]:
    """The memory tier alone (no disk competing for the cores): save blocking, durable and load, each paired
    with a memcpy measured right before it."""
    config = engine_config(disk, shm / "memory-only", part_size, state_nbytes(state), with_disk=False)
    pairs: dict[str, list[float]] = {"save blocking / memcpy": [], "durable / memcpy": [], "load / memcpy": []}
    async with Engine(config) as engine:
        await (await engine.save(0, state)).wait()  # allocates the buffers
        await (await engine.save(1, state)).wait()
        await (await engine.save(2, state)).wait()
        target = {k: torch.zeros_like(v) for k, v in state.items()}  # touched, as a live model's tensors are
        for step in range(3, 3 + repeats):
            copy = baselines.memcpy(state, 1)
            t = time.perf_counter()
            handle = await engine.save(step, state)
            blocking = time.perf_counter() - t
            await handle.wait()
            pairs["save blocking / memcpy"].append(blocking / copy)
            pairs["durable / memcpy"].append(handle.durable_at["host"] / copy)
            copy = baselines.memcpy(state, 1)
            t = time.perf_counter()
            await engine.load(target)
            pairs["load / memcpy"].append((time.perf_counter() - t) / copy)
    return {k: _spread(v) for k, v in pairs.items()}


def report(r: dict[str, Any]) -> str:
    n = r["bytes"]
    gbs = lambda s: n / s / 1e9  # noqa: E731
    lines = [f"state: {format_size(n)} in {r['tensors']} tensors; torch {r['torch']}, python {r['python']}, "
             f"cuda={r['cuda']}; median of {r['repeats']}", "",
             "| figure | seconds | GB/s |", "|---|---:|---:|"]
    rows = [("memcpy into pre-allocated buffers", "memcpy"), ("raw write + fsync (16 MiB os.write)", "raw_write"),
            ("raw cold sequential read", "raw_read"), ("torch.save + fsync", "torch_save"),
            ("torch.load (cold)", "torch_load"), ("DCP save (thread_count=2)", "dcp_save"),
            ("DCP async_save: return", "dcp_async_return"), ("DCP async_save: staged", "dcp_async_staged"),
            ("DCP async_save: durable", "dcp_async_durable"), ("DCP load (cold)", "dcp_load"),
            ("tiered_ckpt first save: blocking (allocates buffers)", "first_save_blocking"),
            ("tiered_ckpt save: blocking", "save_blocking"), ("tiered_ckpt lazy save: return", "lazy_return"),
            ("tiered_ckpt lazy save: staged", "lazy_staged"), ("tiered_ckpt durable on memory tier", "durable_host"),
            ("tiered_ckpt durable on disk tier", "durable_disk"), ("tiered_ckpt load from memory tier", "load_host"),
            ("tiered_ckpt load from disk tier (cold)", "load_disk")]
    for label, key in rows:
        if key in r:
            lines.append(f"| {label} | {r[key]:.4f} | {gbs(r[key]):.2f} |")
    lines += ["", f"plan: first {r['plan_miss'] * 1e3:.3f} ms, cached {r['plan_hit'] * 1e3:.3f} ms; peak extra RSS: "
              f"first save until durable {format_size(r['peak_extra_rss'])} (its buffer, which the memory tier keeps, "
              f"and the next save's, prepared meanwhile), a later save {format_size(r['steady_extra_rss'])}", "",
              "| figure | measured | target | met |", "|---|---:|---:|:---:|"]

    def row(label: str, value: float, target: str, ok: bool) -> None:
        lines.append(f"| {label} | {value:.3f} | {target} | {'yes' if ok else 'NO'} |")

    row("save blocking / memcpy (medians of separate runs)", r["save_blocking"] / r["memcpy"], "≤ 1.1",
        r["save_blocking"] <= 1.1 * r["memcpy"])
    row("lazy save() return (ms)", r["lazy_return"] * 1e3, "≤ 5", r["lazy_return"] <= 0.005)
    row("lazy staged / memcpy", r["lazy_staged"] / r["memcpy"], "≤ 1.3", r["lazy_staged"] <= 1.3 * r["memcpy"])
    row("save blocking / torch.save+fsync", r["save_blocking"] / r["torch_save"], "≤ 0.1",
        r["save_blocking"] <= 0.1 * r["torch_save"])
    if "dcp_async_return" in r:
        row("save blocking / DCP async_save return", r["save_blocking"] / r["dcp_async_return"], "< 1",
            r["save_blocking"] < r["dcp_async_return"])
        row("save blocking / DCP async_save staged", r["save_blocking"] / r["dcp_async_staged"], "< 1",
            r["save_blocking"] < r["dcp_async_staged"])
        row("durable on disk / DCP async_save durable", r["durable_disk"] / r["dcp_async_durable"], "< 1",
            r["durable_disk"] < r["dcp_async_durable"])
    row("disk durable bandwidth / raw write bandwidth", r["raw_write"] / r["durable_disk"], "≥ 0.8",
        r["raw_write"] / r["durable_disk"] >= 0.8)
    row("load from memory / memcpy", r["load_host"] / r["memcpy"], "≤ 1.5", r["load_host"] <= 1.5 * r["memcpy"])
    row("load from disk bandwidth / raw read bandwidth", r["raw_read"] / r["load_disk"], "≥ 0.8",
        r["raw_read"] / r["load_disk"] >= 0.8)
    if "dcp_load" in r:
        row("load from disk / DCP load", r["load_disk"] / r["dcp_load"], "< 1", r["load_disk"] < r["dcp_load"])
    row("cached plan / first plan", r["plan_hit"] / r["plan_miss"], "< 0.02", r["plan_hit"] < 0.02 * r["plan_miss"])
    row("peak extra RSS of a later save / state size", r["steady_extra_rss"] / n, "≤ 1.1",
        r["steady_extra_rss"] <= 1.1 * n)
    lines += ["", "Interleaved pairs (baseline, then tiered_ckpt, repeated): median of the per-pair ratios, with the",
              "smallest and largest.", "", "| ratio | median | min | max | target | met |", "|---|---:|---:|---:|---:|:---:|"]
    for label, spread in r["pairs"].items():
        target, ok = PAIR_TARGETS[label]
        lines.append(f"| {label} | {spread['median']:.3f} | {spread['min']:.3f} | {spread['max']:.3f} | {target} | "
                     f"{'yes' if ok(spread['median']) else 'NO'} |")
    for label, spread in r["memory_only"].items():
        lines.append(f"| memory tier alone: {label} | {spread['median']:.3f} | {spread['min']:.3f} | "
                     f"{spread['max']:.3f} | | |")
    lines += ["", MET_LEGEND]
    return "\n".join(lines)
