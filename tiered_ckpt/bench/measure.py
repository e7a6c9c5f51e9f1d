"""Small measuring tools: timers, medians, cold-cache hints, an RSS sampler, the benchmark state."""
from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ..config import parse_config


def median_time(fn: Callable[[], object], repeats: int, setup: Callable[[], object] = lambda: None) -> float:
    times = []
    for _ in range(repeats):
        setup()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def drop_cache(path: Path) -> None:
    """Ask the kernel to forget a file's (or tree's) cached pages, so the next read comes from disk."""
    files = [path] if path.is_file() else [Path(d, f) for d, _, fs in os.walk(path) for f in fs]
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY)
        except FileNotFoundError:  # retention removed it meanwhile
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def fsync_tree(path: Path) -> None:
    """Make a file or folder tree durable: fsync every file, every folder, and the folder holding it (what a
    library that writes through the page cache without fsync leaves to be done)."""
    for d, _, files in os.walk(path) if path.is_dir() else [(str(path.parent), [], [path.name])]:
        for name in files:
            fd = os.open(Path(d, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    folders = [Path(d) for d, _, _ in os.walk(path)] + [path.parent]
    for folder in folders:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Samples this process's resident set every 2 ms; `peak - start` is the extra memory used."""

    def __enter__(self) -> "PeakRSS":
        self.start = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def extra(self) -> int:
        return self.peak - self.start


def mixed_state(nbytes: int, seed: int = 0, even: bool = False) -> dict[str, torch.Tensor]:
    """About `nbytes` of float32/bfloat16 tensors: 60% in large (64 MiB), 30% medium (4 MiB), 10% small
    (64 KiB) tensors, like a transformer's weights, biases and norms. `even`: an even number of elements in
    every tensor (torchsnapshot 0.1.0 cannot save a bfloat16 tensor of an odd number)."""
    g = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for share, size, dtype in ((0.6, 64 << 20, torch.float32), (0.3, 4 << 20, torch.bfloat16),
                               (0.1, 64 << 10, torch.float32)):
        budget = int(nbytes * share)
        i = 0
        while budget > 0:
            n = min(size, budget)
            elems = max(n // torch.empty((), dtype=dtype).element_size(), 1)
            elems = max(elems - elems % 2, 2) if even else elems
            state[f"{dtype}-{size}-{i}"] = torch.randn(elems, generator=g).to(dtype)
            budget -= n
            i += 1
    return state


def state_nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def engine_config(disk: Path, shm: Path, part_size: int, nbytes: int, *, with_disk: bool = True) -> Any:
    """The benchmarks' tiered_ckpt: a memory tier (/dev/shm) and a disk tier, both keep_last = 1, max_inflight = 1,
    the embedded file index."""
    tiers = [{"name": "host", "kind": "memory", "path": str(shm), "capacity": 3 * nbytes + (1 << 30), "keep_last": 1}]
    if with_disk:
        tiers.append({"name": "disk", "kind": "local", "path": str(disk / "parts"), "keep_last": 1})
    return parse_config({"engine": {"job": "bench", "index": f"file://{disk}/index", "part_size": part_size,
                                    "max_inflight": 1}, "tiers": tiers})
