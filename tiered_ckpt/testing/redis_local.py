"""Throwaway Redis deployments of real processes on this machine, for tests and benchmarks: a Redis
Cluster of N masters (`redis-cli --cluster create`), and a Sentinel deployment (a master, replicas, one
sentinel). No persistence; every process is killed on `stop()`.

Ports are picked below the ephemeral range (a cluster node also needs port + 10000 for its bus), and a
port someone else took meanwhile makes the process exit, so another is tried."""
from __future__ import annotations

import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

from .servers import start_local_server


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _start(argv: Callable[[int], list[str]], *, bus: bool = False, log: Path | None = None,
           port: int | None = None) -> tuple[subprocess.Popen, int]:
    """Start a server on a free port in 20000-29999 (its cluster bus, port + 10000, free too); or on `port`."""
    if port is not None:
        return start_local_server(argv, timeout=10, port=port, log=log)
    for _ in range(20):
        candidate = random.randrange(20000, 30000)
        if not _port_free(candidate) or (bus and not _port_free(candidate + 10000)):
            continue
        try:
            return start_local_server(argv, timeout=10, port=candidate, log=log)
        except RuntimeError:
            continue  # taken between the check and the bind: another one
    raise RuntimeError(f"{argv(0)[0]}: found no free port")


def _cli(port: int, *args: str, timeout: float = 30, password: str | None = None) -> str:
    auth = ["-a", password, "--no-auth-warning"] if password else []
    out = subprocess.run(["redis-cli", "-h", "127.0.0.1", "-p", str(port), *auth, *args], capture_output=True,
                         text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"redis-cli -p {port} {' '.join(args)}: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout


def _wait_for(what: str, test: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if test():
                return
        except (RuntimeError, subprocess.TimeoutExpired):
            pass
        time.sleep(0.05)
    raise RuntimeError(f"timed out after {timeout}s waiting for {what}")


class Process:
    """One redis-server (or sentinel) process; `kill()` sends SIGKILL, `start()` brings it back on its port."""

    def __init__(self, argv: Callable[[int], list[str]], *, bus: bool = False, log: Path | None = None):
        self.argv, self.bus, self.log = argv, bus, log
        self.proc: subprocess.Popen | None = None
        self.port = 0

    def start(self, *extra: str) -> "Process":
        """Start it (again, on the same port), with `extra` arguments this time."""
        argv = self.argv if not extra else (lambda port: [*self.argv(port), *extra])
        self.proc, self.port = _start(argv, bus=self.bus, log=self.log, port=self.port or None)
        return self

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def _server_argv(d: Path, *extra: str) -> Callable[[int], list[str]]:
    return lambda port: ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                         "no", "--dir", str(d), "--logfile", str(d / "redis.log"), *extra]


class LocalServer:
    """One standalone redis-server: `url`."""

    def __init__(self, *extra: str, base: Path | None = None):
        self.dir = Path(tempfile.mkdtemp(prefix="tiered_ckpt-redis-", dir=base))
        self.server = Process(_server_argv(self.dir, *extra)).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.server.port}/0"

    def stop(self) -> None:
        self.server.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "LocalServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class LocalCluster:
    """A Redis Cluster of `masters` masters (no replicas) on this machine: `url` is its redis+cluster:// URL
    (without the `password`, if the nodes require one)."""

    def __init__(self, masters: int = 3, *extra: str, node_timeout_ms: int = 2000, base: Path | None = None,
                 password: str | None = None):
        self.dir = Path(tempfile.mkdtemp(prefix="tiered_ckpt-cluster-", dir=base))
        self.nodes: list[Process] = []
        self.password = password
        if password:
            extra = (*extra, "--requirepass", password, "--masterauth", password)
        try:
            for i in range(masters):
                d = self.dir / f"node{i}"
                d.mkdir()
                self.nodes.append(Process(_server_argv(
                    d, "--cluster-enabled", "yes", "--cluster-config-file", str(d / "nodes.conf"),
                    "--cluster-node-timeout", str(node_timeout_ms), *extra), bus=True).start())
            _cli(self.nodes[0].port, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                 "--cluster-replicas", "0", "--cluster-yes", timeout=60, password=password)
            self.wait_state("ok")
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def node_of(self, key: str) -> Process:
        """The node that serves `key`'s slot."""
        live = next(n for n in self.nodes if n.alive)
        slot = int(_cli(live.port, "cluster", "keyslot", key, password=self.password))
        for line in _cli(live.port, "cluster", "nodes", password=self.password).splitlines():
            fields = line.split()
            if "master" not in fields[2]:
                continue
            port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
            for spec in fields[8:]:
                lo, _, hi = spec.partition("-")
                if not spec.startswith("[") and int(lo) <= slot <= int(hi or lo):
                    return next(n for n in self.nodes if n.port == port)
        raise RuntimeError(f"no node serves slot {slot} of {key!r}")

    def wait_state(self, state: str, timeout: float = 30) -> None:
        """Wait until every live node reports cluster_state:`state` (ok, fail)."""
        _wait_for(f"cluster_state:{state}", lambda: all(
            f"cluster_state:{state}" in _cli(n.port, "cluster", "info", password=self.password)
            for n in self.nodes if n.alive), timeout)

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class LocalSentinel:
    """A master, `replicas` replicas and one sentinel (quorum 1) watching it as `name`, with short failure
    detection (`down_after_ms`) and failover timeout: `url` is its redis+sentinel:// URL (database 0)."""

    def __init__(self, replicas: int = 1, *, name: str = "ckpt", down_after_ms: int = 500,
                 failover_timeout_ms: int = 2000, base: Path | None = None):
        self.name = name
        self.dir = Path(tempfile.mkdtemp(prefix="tiered_ckpt-sentinel-", dir=base))
        self.servers: list[Process] = []
        self.sentinel: Process | None = None
        try:
            (self.dir / "master").mkdir()
            # a replica syncs at once (the default waits 5 s); tests may freeze a replica (DEBUG SLEEP, local only)
            fast = ("--repl-diskless-sync-delay", "0", "--enable-debug-command", "local")
            master = Process(_server_argv(self.dir / "master", *fast)).start()
            self.servers.append(master)
            for i in range(replicas):
                d = self.dir / f"replica{i}"
                d.mkdir()
                self.servers.append(Process(_server_argv(d, *fast, "--replicaof", "127.0.0.1", str(master.port))).start())
            _wait_for("replicas in sync", lambda: _cli(master.port, "info", "replication").count(",state=online,")
                      >= replicas, 30)
            conf = self.dir / "sentinel.conf"

            def sentinel_argv(port: int) -> list[str]:
                conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {self.dir}\nlogfile {self.dir / 'sentinel.log'}\n"
                                f"sentinel monitor {name} 127.0.0.1 {master.port} 1\n"
                                f"sentinel down-after-milliseconds {name} {down_after_ms}\n"
                                f"sentinel failover-timeout {name} {failover_timeout_ms}\n"
                                f"sentinel parallel-syncs {name} 1\n")
                return ["redis-server", str(conf), "--sentinel"]

            self.sentinel = Process(sentinel_argv).start()
            _wait_for("the sentinel to see the replicas", lambda: _cli(
                self.sentinel.port, "sentinel", "replicas", name).count("\n") > 0 or not replicas, 30)
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        assert self.sentinel is not None
        return f"redis+sentinel://127.0.0.1:{self.sentinel.port}/{self.name}/0"

    def master_port(self) -> int:
        """The master's port as the sentinel sees it now."""
        assert self.sentinel is not None
        return int(_cli(self.sentinel.port, "sentinel", "get-master-addr-by-name", self.name).split()[1])

    def server_on(self, port: int) -> Process:
        return next(s for s in self.servers if s.port == port)

    def wait_for_failover(self, old_port: int, timeout: float = 30) -> int:
        """Wait until the sentinel names another master than `old_port`, and it accepts writes; its port."""
        _wait_for("a failover", lambda: self.master_port() != old_port and "role:master" in _cli(
            self.master_port(), "info", "replication"), timeout)
        return self.master_port()

    def rejoin(self, port: int) -> None:
        """Bring the server that was on `port` back, empty, as a replica of the current master: what an operator
        does with a node that has no persistence. (Restarted as an empty master instead, the sentinel may promote
        it before it has synced, and the data set is gone: the Redis docs warn against auto-restarting such nodes.)"""
        self.server_on(port).start("--replicaof", "127.0.0.1", str(self.master_port()))

    def stop(self) -> None:
        for p in [*self.servers, *([self.sentinel] if self.sentinel else [])]:
            p.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "LocalSentinel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
