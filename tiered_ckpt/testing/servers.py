"""Throwaway local servers for tests and benchmarks (redis-server, moto_server): started on a free port, and
counted as started only once their own process listens there."""
from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable


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
