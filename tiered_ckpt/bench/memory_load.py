"""Where the time of a load from the memory tier goes, step by step (#30 item 4).

`python -m tiered_ckpt.bench.memory_load [--size 1GiB] [--repeats 3]`: saves one state of that size to a
memory tier (tmpfs), then times, in this process, the load from that tier beside each step it is made of, on
the same files and the same bytes: the load's work before it reads a byte (the manifest, pairing the state
with it, planning the reads); reading the part files into a cache-sized buffer (`os.preadv`, the path the load
takes), hashing every chunk (the checksum the manifest records), copying into the tensors (memcpy); the
load's own chunk loop (read, verify, scatter into the state's tensors) run alone on `--threads` threads, the
floor of a verified load here; and, for comparison, mapping the files instead of reading them, touching every
page or with MAP_POPULATE on `--threads` threads (what a load through `mmap` would pay in page-table
population instead of the read's copy). Medians; one JSON line with `--json`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
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


def map_populated(path: Path) -> None:
    """Map a file with MAP_POPULATE (the kernel fills the page tables at once) and unmap it."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size:
            mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                      prot=mmap.PROT_READ).close()


def verified_loop(parts: list[tuple[Path, Any]], algorithm: str, threads: int) -> None:
    """The load's own work and nothing else: each part file read a chunk at a time into a buffer of its
    thread, each chunk checked against its digest and scattered into the state's tensors (`Sinks`), the parts
    spread over `threads` threads."""
    def one(item: tuple[Path, Any]) -> None:
        path, part = item
        buf = memoryview(bytearray(CHUNK))
        sums = memoryview(part.chunk_sums).cast("B")
        fd = os.open(path, os.O_RDONLY)
        try:
            at = 0
            while at < part.length:
                n = os.preadv(fd, [buf[:min(CHUNK, part.length - at)]], at)
                if n <= 0:
                    raise OSError(f"{path}: short read at {at}")
                index = at // CHUNK
                if chunk_digest(buf[:n], algorithm) != int.from_bytes(sums[8 * index:8 * index + 8], "little"):
                    raise ValueError(f"{path}: chunk {index} does not match its digest")
                part.views.scatter([buf[:n]], at)
                at += n
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, parts))


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


async def measure(nbytes: int, repeats: int, shm: Path, work: Path, threads: int = 2) -> dict[str, Any]:
    import tiered_ckpt as tc
    from tiered_ckpt.config import parse_config
    from tiered_ckpt.load.reads import parts_to_read, plan_reads

    state = mixed_state(nbytes, even=True)
    config = parse_config({"engine": {"job": "memload", "index": f"file://{work}/index", "part_size": "64MiB"},
                           "tiers": [{"name": "host", "kind": "memory", "path": str(shm), "keep_last": 1}]})
    out: dict[str, Any] = {"bytes": state_nbytes(state), "tensors": len(state), "threads": threads}
    async with tc.Engine(config) as engine:
        await (await engine.save(1, state)).wait()
        await engine.pool.settle()  # the next buffer, made ahead in the background, would compete with the loads
        manifest = await engine.read_manifest(1)
        algorithm = manifest.checksum
        loads, fixed = [], []
        for _ in range(repeats):
            started = time.perf_counter()
            info = await engine.load(state, tiers=["host"])
            loads.append(time.perf_counter() - started)
            assert info.tier == "host" and not info.fallbacks
            started = time.perf_counter()  # what the load does before its first read, on the same manifest
            await engine.read_manifest(1)
            target = engine._loader._match(state, manifest)
            parts = parts_to_read(manifest, plan_reads(manifest, target.tensors))
            fixed.append(time.perf_counter() - started)
        out["load"] = sorted(loads)[len(loads) // 2]
        out["fixed"] = sorted(fixed)[len(fixed) // 2]
        tier = engine.store.io.file_tier("host")
        assert tier is not None
        keyed = [(tier.path_of(p.key), p) for p in parts.values()]
        out["verified_loop"] = median_time(lambda: verified_loop(keyed, algorithm, threads), repeats)
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
    with ThreadPoolExecutor(threads) as pool:
        out["map_populate"] = median_time(lambda: list(pool.map(map_populated, files)), repeats)
    out["hash"] = out["read_hash"] - out["read"]
    return out


def report(r: dict[str, Any]) -> str:
    m = r["memcpy"]
    t = r["threads"]
    rows = [("load(tiers=['host']) (verified, into the live tensors)", r["load"]),
            ("of it, before the first read: manifest, pairing the state, planning the reads", r["fixed"]),
            (f"the load's chunk loop alone on {t} threads: read, verify, scatter into the tensors", r["verified_loop"]),
            ("read the part files into an 8 MiB buffer (os.preadv), one thread", r["read"]),
            (f"hash every 1 MiB chunk ({r['checksum']}), beside the read", r["hash"]),
            ("memcpy of the same bytes (the copy into the tensors)", m),
            ("read + hash + memcpy (the load's work, summed)", r["read_hash"] + m),
            ("instead of the read: mmap the files and touch every page", r["map_touch"]),
            (f"instead of the read: mmap the files with MAP_POPULATE, {t} threads", r["map_populate"])]
    lines = [f"{format_size(r['bytes'])} in {r['tensors']} tensors, medians", "",
             "| step | s | × memcpy |", "|---|---:|---:|"]
    lines += [f"| {name} | {s:.4f} | {s / m:.2f} |" for name, s in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tiered_ckpt.bench.memory_load", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="1GiB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--shm", default="/dev/shm", help="where the memory tier's folder is made")
    p.add_argument("--threads", type=int, default=min(4, os.cpu_count() or 1),
                   help="threads of the chunk loop alone and of MAP_POPULATE (default: cores, at most 4)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tiered_ckpt-memload-", dir=args.shm) as shm, \
            tempfile.TemporaryDirectory(prefix="tiered_ckpt-memload-") as work:
        result = asyncio.run(measure(parse_size(args.size), args.repeats, Path(shm), Path(work), args.threads))
    print(json.dumps(result) if args.json else report(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
