"""Cluster nodes emulated on one machine with Linux namespaces, for multi-node tests.

A node is a mount + UTS + PID namespace (unshare, as root): its own hostname, its own /dev/shm (a tmpfs
that vanishes with the node), its own /proc, an /etc/hosts naming every node, and a private disk folder
(root/disks/nodeI) seen at one common path, root/local, as every node of a cluster has "the same local
path" on its own disk. The network namespace is shared: node i serves on 127.0.0.(10+i), an address lo
already answers (all of 127.0.0.0/8), so no veth or bridge is needed and the test reaches every node.

Killing a node's holder kills the namespace's init, and the kernel then kills every process in the PID
namespace: a lost machine. kill() also wipes its disk; start() brings the node back fresh and empty under
the same name and address.

    cluster = Cluster.start(tmp_path, 3)           # node0..node2, each with its peer redis-server
    results = cluster.run_job([sys.executable, WORKER], env_extra={"SPEC": ...})
    cluster.nodes[1].kill(); cluster.nodes[1].start()
    cluster.stop()
"""
from __future__ import annotations

import json
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parents[2]
# --fork: the command is the namespace's init (PID 1); --kill-child: it dies with unshare; --mount-proc: a
# /proc of the node's own PID namespace (unshare also makes the mounts private, so nothing leaks out).
UNSHARE = ["unshare", "--mount", "--uts", "--pid", "--fork", "--kill-child", "--mount-proc"]


def namespaces_work() -> str | None:
    """None when this machine lets us create a node's namespaces (root or CAP_SYS_ADMIN), else why not."""
    for tool in ("unshare", "nsenter", "redis-server"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    try:
        probe = subprocess.run([*UNSHARE, "true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    return None if probe.returncode == 0 else (probe.stderr.strip() or f"unshare exited {probe.returncode}")


def tail(path: Path, lines: int = 40) -> str:
    text = path.read_text(errors="replace") if path.exists() else "(no log)"
    return f"--- {path} ---\n" + "\n".join(text.splitlines()[-lines:])


def _pid_namespace(pid: int) -> str | None:
    """The PID namespace of a running process; None when it is gone or a zombie (it runs nothing)."""
    try:
        if Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z":
            return None
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def _answers(host: str, port: int) -> bool:
    """A redis-server answers PING there (a raw socket: redis-py's retries would make "no" take seconds)."""
    try:
        with socket.create_connection((host, port), timeout=1) as s:
            s.sendall(b"PING\r\n")
            return s.recv(7) == b"+PONG\r\n"
    except OSError:
        return False


class Node:
    """One emulated machine: a holder process owning the namespaces, and its peer redis-server inside."""

    def __init__(self, cluster: Cluster, index: int):
        self.cluster, self.index = cluster, index
        self.name, self.ip = f"node{index}", f"127.0.0.{10 + index}"
        self.disk = cluster.root / "disks" / self.name
        self.holder: subprocess.Popen | None = None
        self.init_pid = 0  # the namespace's PID 1, as the host sees it: nsenter's target
        self.pid_ns = ""   # e.g. "pid:[4026532185]": how kill() recognises the node's processes
        self.procs: list[subprocess.Popen] = []

    @property
    def alive(self) -> bool:
        return self.holder is not None and self.holder.poll() is None

    def start(self) -> Node:
        """Create the namespaces, mount the node's view, start its redis-server; return once it answers."""
        assert not self.alive, f"{self.name} is already running"
        root, q = self.cluster.root, shlex.quote
        self.disk.mkdir(parents=True, exist_ok=True)
        setup = (f"set -e; mount -t tmpfs -o size=512m tmpfs /dev/shm; hostname {self.name}; "
                 f"mount --bind {q(str(root / 'hosts'))} /etc/hosts; "
                 f"mount --bind {q(str(self.disk))} {q(str(root / 'local'))}; exec sleep infinity")
        log = root / "logs" / f"{self.name}.log"
        with open(log, "ab") as out:
            self.holder = subprocess.Popen([*UNSHARE, "sh", "-c", setup], stdin=subprocess.DEVNULL, stdout=out,
                                           stderr=subprocess.STDOUT, start_new_session=True)
        self.init_pid = self._wait_for_init(log)
        self.pid_ns = _pid_namespace(self.init_pid) or ""
        # inside the node, so it dies with it; --dir in the node's tmpfs (nothing is saved: --save '')
        server = self.spawn(["redis-server", "--bind", self.ip, "--port", str(self.cluster.redis_port),
                             "--save", "", "--appendonly", "no", "--daemonize", "no", "--dir", "/dev/shm"],
                            log=f"{self.name}-redis")
        deadline = time.monotonic() + 15
        while not _answers(self.ip, self.cluster.redis_port):
            if server.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"{self.name}: redis-server did not answer\n"
                                   + tail(root / "logs" / f"{self.name}-redis.log"))
            time.sleep(0.05)
        return self

    def _wait_for_init(self, log: Path) -> int:
        """The child of unshare is the namespace's init; it is ready once the setup exec'd into sleep."""
        assert self.holder is not None
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.holder.poll() is not None:
                raise RuntimeError(f"{self.name}: the namespace setup failed (exit {self.holder.returncode})\n"
                                   + tail(log))
            try:
                children = Path(f"/proc/{self.holder.pid}/task/{self.holder.pid}/children").read_text().split()
                if children and Path(f"/proc/{children[0]}/cmdline").read_bytes().startswith(b"sleep\0"):
                    return int(children[0])
            except OSError:
                pass
            time.sleep(0.02)
        self.holder.kill()
        raise RuntimeError(f"{self.name}: the namespace init did not start\n" + tail(log))

    def spawn(self, argv: Sequence[str], env: dict[str, str] | None = None, *, log: str) -> subprocess.Popen:
        """Run argv inside the node (its hostname, /etc/hosts, /dev/shm, disk; PID namespace, so it dies with
        the node), cwd the repo root, environment os.environ + env, output to root/logs/<log>.log. The Popen
        is nsenter's, outside, which waits for the command and returns its exit status; it leads its own
        process group (start_new_session), so killpg(p.pid) kills the command too."""
        assert self.alive, f"{self.name} is not running"
        path = self.cluster.root / "logs" / f"{log}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab") as out:
            proc = subprocess.Popen(
                ["nsenter", f"--target={self.init_pid}", "--mount", "--uts", "--pid", f"--wdns={REPO}", "--",
                 *argv], env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def reboot(self) -> Node:
        """Restart the machine: every process of it killed, its memory (/dev/shm) and its Redis gone, its disk kept."""
        self.kill(wipe_disk=False)
        return self.start()

    def kill(self, *, wipe_disk: bool = True) -> None:
        """Lose the node: SIGKILL its init (the kernel kills the whole PID namespace) and holder, check that
        nothing of it runs on, wipe its disk (unless `wipe_disk` is False: a reboot). Its tmpfs went with the
        mount namespace."""
        if self.holder is None:
            return
        if self.holder.poll() is None:  # while unshare lives, its child init_pid cannot have been reused
            os.kill(self.init_pid, signal.SIGKILL)
            try:  # unshare reaps its init and exits (killed at once, it would leave a zombie init for the host)
                self.holder.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.holder.kill()
        self.holder.wait()
        for proc in self.procs:  # nsenter returns once its command is dead
            proc.wait(timeout=30)
        deadline = time.monotonic() + 15
        while self.pid_ns and (left := [p for p in os.listdir("/proc") if p.isdigit() and _pid_namespace(int(p))
                                        == self.pid_ns]):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: processes {left} outlived the node")
            time.sleep(0.05)
        assert not _answers(self.ip, self.cluster.redis_port), f"{self.name}'s redis-server still answers"
        if wipe_disk:
            shutil.rmtree(self.disk, ignore_errors=True)
            self.disk.mkdir(parents=True)
        self.holder, self.init_pid, self.pid_ns, self.procs = None, 0, "", []


def free_port(*hosts: str) -> int:
    """A TCP port free on every one of hosts (a node's redis binds only its own address), below the kernel's
    ephemeral range: a port that bind(0) hands out is from that range, and between this check and the server's
    own bind an outgoing connection (gloo's, a Redis client's) can take it (a job's TCPStore once failed with
    EADDRINUSE so)."""
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    for _ in range(200):
        port = random.randrange(10000, max(ephemeral, 10001))
        try:
            for host in hosts:
                with socket.socket() as s:
                    s.bind((host, port))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no port free on all of {hosts}")


class Cluster:
    """n nodes under root: root/hosts, root/disks/nodeI, root/local (the common mount point, empty outside),
    root/logs (every process's output), root/results/<job> (the workers' JSON results)."""

    def __init__(self, root: Path, n: int, redis_port: int):
        self.root, self.redis_port, self.jobs = Path(root), redis_port, 0
        for sub in ("disks", "logs", "results", "local"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.nodes = [Node(self, i) for i in range(n)]
        # the machine's lines (localhost, ...) plus every node: a node resolves its peers by name
        (self.root / "hosts").write_text(Path("/etc/hosts").read_text().rstrip("\n") + "\n"
                                         + "".join(f"{node.ip} {node.name}\n" for node in self.nodes))

    @classmethod
    def start(cls, root: Path, n: int) -> Cluster:
        cluster = cls(root, n, free_port(*(f"127.0.0.{10 + i}" for i in range(n))))
        try:
            for node in cluster.nodes:
                node.start()
        except BaseException:
            cluster.stop()
            raise
        return cluster

    @property
    def peer_urls(self) -> list[str]:
        """Every node's redis-server by name, in node order (a redis peer tier's `urls`)."""
        return [f"redis://{node.name}:{self.redis_port}" for node in self.nodes]

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()

    def run_job(self, worker_argv: Sequence[str], nodes_order: Sequence[int] | None = None, procs_per_node: int = 1,
                env_extra: dict[str, str] | None = None, timeout: float = 180.0, may_fail: bool = False,
                name: str | None = None) -> list[dict]:
        """start_job, then Job.wait."""
        return self.start_job(worker_argv, nodes_order, procs_per_node, env_extra, name).wait(timeout, may_fail)

    def start_job(self, worker_argv: Sequence[str], nodes_order: Sequence[int] | None = None, procs_per_node: int = 1,
                  env_extra: dict[str, str] | None = None, name: str | None = None) -> Job:
        """Start a torch.distributed job as torchrun's static rendezvous would place it, but starting the
        workers directly (torchrun's agents cost too much on 2 cores): procs_per_node ranks on each node of
        nodes_order, whose position is the node's GROUP_RANK ([0, 2, 1]: node2 is group 1). Each worker
        writes its JSON result to $RESULT."""
        order = list(range(len(self.nodes)) if nodes_order is None else nodes_order)
        self.jobs += 1
        run = name or f"job{self.jobs}"
        results = self.root / "results" / run
        results.mkdir(parents=True)
        world, port = len(order) * procs_per_node, free_port("127.0.0.1")
        ranks: list[tuple[Node, subprocess.Popen]] = []
        for group, index in enumerate(order):
            for local in range(procs_per_node):
                rank = group * procs_per_node + local
                env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
                       "LOCAL_WORLD_SIZE": str(procs_per_node), "GROUP_RANK": str(group),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo",
                       "TORCH_CPP_LOG_LEVEL": "ERROR", "OMP_NUM_THREADS": "1",
                       "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                       "RESULT": str(results / f"rank{rank}.json"), **(env_extra or {})}
                node = self.nodes[index]
                ranks.append((node, node.spawn(worker_argv, env, log=f"{run}/rank{rank}")))
        logs = [self.root / "logs" / run / f"rank{rank}.log" for rank in range(world)]
        return Job(run, ranks, logs, results)


class Job:
    """A started job: its ranks (node, nsenter's Popen), their logs and result files."""

    def __init__(self, name: str, ranks: list[tuple[Node, subprocess.Popen]], logs: list[Path], results: Path):
        self.name, self.ranks, self.logs, self.results = name, ranks, logs, results

    def wait(self, timeout: float = 180.0, may_fail: bool = False) -> list[dict]:
        """One dict per rank, in rank order: the result plus rank, node and exitcode; raises with the log tails
        of failed ranks unless may_fail, and of every rank on timeout (after killing them all)."""
        deadline = time.monotonic() + timeout
        try:
            codes = [proc.wait(timeout=max(deadline - time.monotonic(), 0.1)) for _, proc in self.ranks]
        except subprocess.TimeoutExpired:
            for _, proc in self.ranks:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
            raise TimeoutError(f"{self.name}: not done after {timeout} s; killed every rank\n"
                               + "\n".join(tail(log) for log in self.logs)) from None
        out = []
        for rank, ((node, _), code) in enumerate(zip(self.ranks, codes)):
            path = self.results / f"rank{rank}.json"
            out.append({**(json.loads(path.read_text()) if path.exists() else {}),
                        "rank": rank, "node": node.name, "exitcode": code})
        failed = [rank for rank, code in enumerate(codes) if code != 0]
        if failed and not may_fail:
            raise RuntimeError(f"{self.name}: ranks {failed} failed (exit codes {[codes[r] for r in failed]})\n"
                               + "\n".join(tail(self.logs[r]) for r in failed))
        return out
