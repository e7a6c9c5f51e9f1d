"""tiered_ckpt's DCP writer and reader against DCP's own FileSystemWriter/Reader, in one run (issue 45).

`python -m tiered_ckpt.bench.dcp_bench [--size 1GiB] [--repeats N] [--json]`: one process, no process group. Each writer
saves the same state twice through `dcp.async_save` (thread mode; DCP's writer with its default stager, ours
staging through the engine) and the second save is timed: "blocked" is how long async_save held the training
thread, "durable" how long until its future completed (ours: committed on the memory tier; DCP: its files
written and fsync'd), and for ours also until the disk tier committed. Then each checkpoint is loaded with
`dcp.load` into zeroed tensors: ours from the memory tier and from the disk tier alone, DCP's from its files,
both disk loads with their files evicted from the page cache first (posix_fadvise DONTNEED), and every load
checked bit-equal. Ratios are ours over DCP's.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from ..sizes import format_size, parse_size
from .measure import engine_config, mixed_state, state_nbytes


def evict(folder: Path) -> None:
    """Drop the folder's files from the page cache, so a load reads the disk (as after a restart)."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def timed_async_save(state: dict[str, Any], writer: Any) -> tuple[float, float]:
    import torch.distributed.checkpoint as dcp

    started = time.perf_counter()
    future = dcp.async_save(state, storage_writer=writer)
    blocked = time.perf_counter() - started
    future.result()
    return blocked, time.perf_counter() - started


def timed_load(like: dict[str, torch.Tensor], reader: Any, expected: dict[str, torch.Tensor]) -> float:
    import torch.distributed.checkpoint as dcp

    target = {k: torch.zeros_like(v) for k, v in like.items()}
    started = time.perf_counter()
    dcp.load(target, storage_reader=reader)
    seconds = time.perf_counter() - started
    bad = [k for k in expected if not torch.equal(target[k], expected[k])]
    if bad:
        raise AssertionError(f"loaded {bad[0]!r} differs from what was saved")
    return seconds


def run(size: int, shm: Path, root: Path) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from ..dcp import StorageReader, StorageWriter, close

    state = mixed_state(size)
    config = engine_config(root / "tiered", shm, 64 << 20, state_nbytes(state))
    out: dict[str, Any] = {"bytes": state_nbytes(state)}
    fs = [root / "fs1", root / "fs2"]
    for n, step in enumerate((1, 2)):  # the first save of each warms up (buffers, files); the second is timed
        writer = StorageWriter(config, step=step)
        blocked, durable = timed_async_save(state, writer)
        assert writer.handle is not None
        writer.handle.wait()  # every tier: the disk too, before DCP's save starts
        fs_blocked, fs_durable = timed_async_save(state, dcp.FileSystemWriter(str(fs[n])))
        if step == 2:
            out.update(tiered_blocked=blocked, tiered_durable=durable, fs_blocked=fs_blocked, fs_durable=fs_durable)
    out["tiered_durable_disk"] = _disk_time(state, config)
    out["load_memory"] = timed_load(state, StorageReader(config, tiers=["host"]), state)
    evict(root / "tiered")
    out["load_disk"] = timed_load(state, StorageReader(config, tiers=["disk"]), state)
    evict(fs[1])
    out["fs_load_disk"] = timed_load(state, dcp.FileSystemReader(str(fs[1])), state)
    out["fs_load_cached"] = timed_load(state, dcp.FileSystemReader(str(fs[1])), state)
    close()
    for a, b in (("blocked", "fs_blocked"), ("durable", "fs_durable"), ("durable_disk", "fs_durable")):
        out[f"ratio_{a}"] = out[f"tiered_{a}"] / out[b]
    out["ratio_load_memory"] = out["load_memory"] / out["fs_load_cached"]
    out["ratio_load_disk"] = out["load_disk"] / out["fs_load_disk"]
    return out


def _disk_time(state: dict[str, torch.Tensor], config: Any) -> float:
    """A third timed save: async_save's start until the disk tier committed it (the writer waits for every
    tier)."""
    from ..dcp import StorageWriter

    return timed_async_save(state, StorageWriter(config, step=3, durable="all"))[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--shm", default="/dev/shm" if Path("/dev/shm").is_dir() else None)
    parser.add_argument("--repeats", type=int, default=1, help="whole runs (fresh folders each); medians")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    runs = []
    for _ in range(args.repeats):
        root = Path(tempfile.mkdtemp(prefix="tiered_ckpt-dcp-bench-"))
        shm = Path(tempfile.mkdtemp(prefix="tiered_ckpt-dcp-bench-", dir=args.shm))
        try:
            runs.append(run(parse_size(args.size), shm, root))
        finally:
            shutil.rmtree(root, ignore_errors=True)
            shutil.rmtree(shm, ignore_errors=True)
    out = {k: sorted(r[k] for r in runs)[len(runs) // 2] for k in runs[0]}
    out["runs"] = runs
    if args.json:
        print(json.dumps(out))
        return
    print(f"state {format_size(out['bytes'])}; second save timed; ratios are tiered_ckpt / DCP FileSystemWriter")
    print(f"async_save blocked   {out['tiered_blocked']:.3f}s vs {out['fs_blocked']:.3f}s  "
          f"ratio {out['ratio_blocked']:.2f}")
    print(f"durable (memory)     {out['tiered_durable']:.3f}s vs {out['fs_durable']:.3f}s  "
          f"ratio {out['ratio_durable']:.2f}")
    print(f"durable (disk tier)  {out['tiered_durable_disk']:.3f}s vs {out['fs_durable']:.3f}s  "
          f"ratio {out['ratio_durable_disk']:.2f}")
    print(f"load, memory tier    {out['load_memory']:.3f}s vs {out['fs_load_cached']:.3f}s (DCP, page cache)  "
          f"ratio {out['ratio_load_memory']:.2f}")
    print(f"load, disk (cold)    {out['load_disk']:.3f}s vs {out['fs_load_disk']:.3f}s  "
          f"ratio {out['ratio_load_disk']:.2f}")


if __name__ == "__main__":
    main()
