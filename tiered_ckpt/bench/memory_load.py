"""Where the time of a load from the memory tier goes, step by step (#30 item 4).

`python -m tiered_ckpt.bench.memory_load [--size 1GiB] [--repeats 3]`: saves one state of that size to a
memory tier (tmpfs), then times, in this process, the load from that tier beside each step it is made of, on
the same files and the same bytes: reading the part files into a cache-sized buffer (`os.preadv`, the path
the load takes), hashing every chunk (the checksum the manifest records), copying into the tensors (memcpy),
and, for comparison, mapping the files and touching every page (what a load through `mmap` would pay in
page-table population instead of the read's copy). Medians; one JSON line with `--json`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ..checksum import chunk_digest
from ..sizes import format_size, parse_size
from .measure import mixed_state, state_nbytes

CHUNK = 1 << 20
SPAN = 8 << 20  # the read buffer: a few chunks, stays in cache


def median_time(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def part_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("part-*") if p.is_file())


def read_all(files: list[Path], consume: Callable[[memoryview], None]) -> None:
    buf = memoryview(bytearray(SPAN))
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            at = 0
            while True:
                n = os.preadv(fd, [buf], at)
                if n <= 0:
                    break
                for piece in range(0, n, CHUNK):
                    consume(buf[piece:min(piece + CHUNK, n)])
                at += n
        finally:
            os.close(fd)


def map_and_touch(files: list[Path]) -> None:
    for path in files:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if not size:
                continue
            with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
                view = memoryview(m)
                try:
                    for at in range(0, size, 4096):
                        view[at]
                finally:
                    view.release()


async def measure(nbytes: int, repeats: int, shm: Path, work: Path) -> dict[str, Any]:
    import tiered_ckpt as tc
    from tiered_ckpt.config import parse_config

    state = mixed_state(nbytes, even=True)
    config = parse_config({"engine": {"job": "memload", "index": f"file://{work}/index", "part_size": "64MiB"},
                           "tiers": [{"name": "host", "kind": "memory", "path": str(shm), "keep_last": 1}]})
    out: dict[str, Any] = {"bytes": state_nbytes(state), "tensors": len(state)}
    async with tc.Engine(config) as engine:
        await (await engine.save(1, state)).wait()
        algorithm = (await engine.read_manifest(1)).checksum
        loads = []
        for _ in range(repeats):
            started = time.perf_counter()
            info = await engine.load(state, tiers=["host"])
            loads.append(time.perf_counter() - started)
            assert info.tier == "host" and not info.fallbacks
        out["load"] = sorted(loads)[len(loads) // 2]
    files = part_files(shm)
    out["checksum"] = algorithm
    out["read"] = median_time(lambda: read_all(files, lambda chunk: None), repeats)
    out["read_hash"] = median_time(lambda: read_all(files, lambda chunk: chunk_digest(chunk, algorithm)), repeats)
    flat = torch.empty(out["bytes"], dtype=torch.uint8)
    src = torch.empty_like(flat)
    src.zero_()
    flat.zero_()
    out["memcpy"] = median_time(lambda: flat.copy_(src), repeats)
    out["map_touch"] = median_time(lambda: map_and_touch(files), repeats)
    out["hash"] = out["read_hash"] - out["read"]
    return out


def report(r: dict[str, Any]) -> str:
    m = r["memcpy"]
    rows = [("load(tiers=['host']) (verified, into the live tensors)", r["load"]),
            ("read the part files into an 8 MiB buffer (os.preadv)", r["read"]),
            (f"hash every 1 MiB chunk ({r['checksum']}), beside the read", r["hash"]),
            ("memcpy of the same bytes (the copy into the tensors)", m),
            ("read + hash + memcpy (the load's work, summed)", r["read_hash"] + m),
            ("instead of the read: mmap the files and touch every page", r["map_touch"])]
    lines = [f"{format_size(r['bytes'])} in {r['tensors']} tensors, medians", "",
             "| step | s | × memcpy |", "|---|---:|---:|"]
    lines += [f"| {name} | {s:.4f} | {s / m:.2f} |" for name, s in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tiered_ckpt.bench.memory_load", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="1GiB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--shm", default="/dev/shm", help="where the memory tier's folder is made")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tiered_ckpt-memload-", dir=args.shm) as shm, \
            tempfile.TemporaryDirectory(prefix="tiered_ckpt-memload-") as work:
        result = asyncio.run(measure(parse_size(args.size), args.repeats, Path(shm), Path(work)))
    print(json.dumps(result) if args.json else report(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
