"""`tiered-ckpt bench --nproc N`: N local ranks (gloo, CPU) holding the same replicated state (data
parallel replicas), tiered_ckpt and DCP side by side in one run: bytes written per rank, save blocking
time, time to durable, load time and bytes read from storage (counted by the kernel: /proc/self/io rchar,
the same way for both)."""
from __future__ import annotations

import asyncio
import datetime
import os
import pickle
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .. import Engine
from ..config import parse_config
from ..sizes import format_size
from .measure import drop_cache, mixed_state, state_nbytes


def read_chars() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def run_dist_bench(nproc: int, size: int, part_size: int, repeats: int, base: Path, shm: Path) -> str:
    work = Path(tempfile.mkdtemp(prefix="dist-", dir=base)).resolve()
    shm_dir = Path(tempfile.mkdtemp(prefix="tiered_ckpt-bench-", dir=shm))
    try:
        spawn_ranks(_rank_main, nproc, str(work), str(shm_dir), size, part_size, repeats)
        results = [pickle.loads((work / f"rank{r}.pkl").read_bytes()) for r in range(nproc)]
        return report(results, nproc)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)


def spawn_ranks(target: Any, world: int, *args: Any) -> None:
    """`target(rank, world, *args)` in `world` fresh processes; an error names their exit codes."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, world, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"a benchmark rank failed: exit codes {[p.exitcode for p in procs]}")


def _rank_main(rank: int, world: int, work: str, shm: str, size: int, part_size: int, repeats: int) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"file://{work}/store", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    state = mixed_state(size)  # identical on every rank
    out: dict[str, Any] = {"bytes": state_nbytes(state)}
    out.update(_dcp(state, Path(work) / "dcp", repeats))
    out.update(asyncio.run(_tiered(state, Path(work) / "tiered", Path(shm), part_size, repeats)))
    Path(work, f"rank{rank}.pkl").write_bytes(pickle.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def _timed_collectively(fn: Any, before: Any = None) -> float:
    if before is not None:
        before()
    dist.barrier()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _dcp(state: dict[str, torch.Tensor], path: Path, repeats: int) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    warnings.filterwarnings("ignore")
    rank = dist.get_rank()
    saves, blocking, durable, loads, reads = [], [], [], [], []
    stager = DefaultStager(StagingOptions(False, False, True, False))
    for i in range(repeats + 1):
        target = path / f"sync{i}"
        saves.append(_timed_collectively(lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(target, thread_count=2))))
        dist.barrier()
        t = time.perf_counter()
        resp = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(path / f"async{i}", thread_count=2),
                              async_stager=stager, async_checkpointer_type=AsyncCheckpointerType.THREAD)
        blocking.append(time.perf_counter() - t)
        resp.upload_completion.result()
        durable.append(time.perf_counter() - t)
    per_rank: dict[int, int] = {}
    for f in (path / "sync0").glob("__*_*.distcp"):
        r = int(f.name.split("_")[2])
        per_rank[r] = per_rank.get(r, 0) + f.stat().st_size
    into = {k: torch.empty_like(v) for k, v in state.items()}
    for _ in range(repeats):
        chars = read_chars()
        loads.append(_timed_collectively(lambda: dcp.load(into, storage_reader=dcp.FileSystemReader(path / "sync0")),
                                         before=lambda: drop_cache(path / "sync0") if rank == 0 else None))
        reads.append(read_chars() - chars)
    stager.close()
    med = statistics.median
    return {"dcp_save": med(saves[1:]), "dcp_async_return": med(blocking[1:]), "dcp_async_durable": med(durable[1:]),
            "dcp_load": med(loads), "dcp_read": med(reads), "dcp_written": per_rank}


async def _tiered(state: dict[str, torch.Tensor], disk: Path, shm: Path, part_size: int, repeats: int) -> dict[str, Any]:
    config = parse_config({
        "engine": {"job": "bench", "index": f"file://{disk}/index", "part_size": part_size},
        "tiers": [{"name": "host", "kind": "memory", "path": str(shm), "capacity": 1 << 40, "keep_last": 1},
                  {"name": "disk", "kind": "local", "path": str(disk / "parts"), "keep_last": 1}]})
    blocking, durable, loads, reads, read_storage, received = [], [], [], [], [], []
    async with Engine(config) as engine:
        await (await engine.save(0, state)).wait()
        for step in range(1, repeats + 1):
            await asyncio.to_thread(dist.barrier)
            t = time.perf_counter()
            handle = await engine.save(step, state)
            blocking.append(time.perf_counter() - t)
            await handle.wait()  # every rank's parts durable on every tier
            durable.append(time.perf_counter() - t)
        plan = next(iter(engine.planner._cache.values()))
        into = {k: torch.empty_like(v) for k, v in state.items()}
        for _ in range(repeats):
            if engine.rank == 0:
                drop_cache(disk / "parts")
            await asyncio.to_thread(dist.barrier)
            chars = read_chars()
            t = time.perf_counter()
            info = await engine.load(into, tiers=["disk"])
            loads.append(time.perf_counter() - t)
            reads.append(read_chars() - chars)
            read_storage.append(sum(info.bytes_by_tier.values()))
            received.append(info.bytes_received)
        assert all(torch.equal(into[k], state[k]) for k in state), "benchmark load did not reproduce the state"
    med = statistics.median
    return {"tc_blocking": med(blocking), "tc_durable": med(durable), "tc_load": med(loads), "tc_read": med(reads),
            "tc_read_storage": med(read_storage), "tc_received": med(received),
            "tc_written": dict(enumerate(plan.rank_nbytes or ()))}  # rank 0's


def report(results: list[dict[str, Any]], nproc: int) -> str:
    size = results[0]["bytes"]
    worst = lambda key: max(r[key] for r in results)  # noqa: E731  a collective op lasts as long as its slowest rank

    def balance(written: dict[int, int]) -> str:
        values = [written.get(r, 0) for r in range(nproc)]
        mean = sum(values) / nproc
        return f"{max(values) / mean:.2f} ({', '.join(format_size(v) for v in values)})"

    dcp_read = sum(r["dcp_read"] for r in results)
    tc_read = sum(r["tc_read"] for r in results)
    lines = [f"{nproc} ranks on one machine, each holding the same {format_size(size)} state (DP={nproc}), "
             f"gloo on CPU; median of the repeats; times are the slowest rank's", "",
             "| figure | DCP | tiered_ckpt | tiered / DCP |", "|---|---:|---:|---:|"]

    def row(label: str, dcp: float, tc: float, unit: str = "s") -> None:
        lines.append(f"| {label} | {dcp:.3f} {unit} | {tc:.3f} {unit} | {tc / dcp:.2f} |")

    lines.append(f"| bytes written per rank, max/mean | {balance(results[0]['dcp_written'])} | "
                 f"{balance(results[0]['tc_written'])} | |")
    row("save blocking (DCP: async_save return)", worst("dcp_async_return"), worst("tc_blocking"))
    row("durable on disk (DCP: async_save done)", worst("dcp_async_durable"), worst("tc_durable"))
    row("DCP save (sync) / tiered durable", worst("dcp_save"), worst("tc_durable"))
    row("load from disk (cold)", worst("dcp_load"), worst("tc_load"))
    lines.append(f"| bytes read by all ranks / checkpoint size (rchar) | {dcp_read / size:.2f} | {tc_read / size:.2f} | "
                 f"{tc_read / dcp_read:.2f} |")
    lines.append(f"| tiered: bytes read from tiers / received by broadcast, all ranks | | "
                 f"{format_size(sum(r['tc_read_storage'] for r in results))} / "
                 f"{format_size(sum(r['tc_received'] for r in results))} | |")
    return "\n".join(lines)
