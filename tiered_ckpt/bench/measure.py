"""Small measuring tools: timers, medians, cold-cache hints, an RSS sampler, the benchmark state."""
from __future__ import annotations

import os
import socket
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

import torch


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


def start_local_server(argv: Callable[[int], list[str]], *, timeout: float = 30.0, attempts: int = 5,
                       log: Path | None = None, port: int | None = None) -> tuple[subprocess.Popen, int]:
    """Start a throwaway server (redis-server, moto_server) on a free port (or on `port`, once: a restart);
    return it and its port.

    A free port can be taken by someone else between choosing it and the server binding it, and a stray
    process may already answer on it: the server counts as started only once *its own* process (still
    alive) owns a listening socket on the port; otherwise another port is tried."""
    tried = [port] if port is not None else [free_port() for _ in range(attempts)]
    for port in tried:
        out = open(log, "ab") if log is not None else subprocess.DEVNULL
        proc = subprocess.Popen(argv(port), stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            if _listens(proc.pid, port):
                return proc, port
            time.sleep(0.05)
        proc.kill()
        proc.wait()
    raise RuntimeError(f"{argv(0)[0]} did not start listening on port(s) {tried}")


def _listens(pid: int, port: int) -> bool:
    """Whether process `pid` (or a thread of it) holds a socket listening on 127.0.0.1:`port`."""
    try:
        inodes = {os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1] for fd in os.listdir(f"/proc/{pid}/fd")
                  if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:[")}
    except OSError:
        return False
    want = f"0100007F:{port:04X}"
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                for line in f.readlines()[1:]:
                    fields = line.split()
                    if fields[3] == "0A" and fields[1].endswith(f":{port:04X}") and fields[9] in inodes:
                        return fields[1] == want or table.endswith("6")
        except OSError:
            continue
    return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def mixed_state(nbytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """About `nbytes` of float32/bfloat16 tensors: 60% in large (64 MiB), 30% medium (4 MiB), 10% small
    (64 KiB) tensors, like a transformer's weights, biases and norms."""
    g = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for share, size, dtype in ((0.6, 64 << 20, torch.float32), (0.3, 4 << 20, torch.bfloat16),
                               (0.1, 64 << 10, torch.float32)):
        budget = int(nbytes * share)
        i = 0
        while budget > 0:
            n = min(size, budget)
            elems = max(n // torch.empty((), dtype=dtype).element_size(), 1)
            state[f"{dtype}-{size}-{i}"] = torch.randn(elems, generator=g).to(dtype)
            budget -= n
            i += 1
    return state


def state_nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())
