"""Shared fixtures: a real on-disk config with a memory tier in /dev/shm and a local-disk tier."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

import tiered_ckpt as tc
from tiered_ckpt.testing.configs import stack_dict, tier_table
from tiered_ckpt.testing.servers import start_local_server
from tiered_ckpt.config import parse_config


# Tests that start real processes (torchrun worlds, the examples, Redis Cluster/Sentinel deployments, fresh
# benchmark processes) are marked slow: `scripts/test.sh` runs the rest first, so a broken change fails in
# about two minutes; `pytest -m "not slow"` is that quick subset alone.
SLOW_FOLDERS = ("e2e", "multirank", "multinode")
SLOW_MODULES = ("test_local_stack.py", "test_hung_processes.py", "test_lightning.py", "test_redis_cluster.py",
                "test_redis_sentinel.py", "test_bench_peers.py", "test_crash.py")


# seconds a test session's agent waits idle before it exits: the default's, so that one agent serves a worker's
# consecutive tests (with 2 s, each test started its own: 1.5 CPU-s each, +6.5 min in the slow phase); the session's
# end stops it (pytest_unconfigure)
AGENT_IDLE = "10"


def pytest_configure(config: pytest.Config) -> None:
    # where the node agent is on: this process's tests (and the ranks and examples they start, which inherit
    # the environment) share one agent folder of their own, never the user's
    if "TIERED_CKPT_AGENT_DIR" not in os.environ:
        folder = tempfile.mkdtemp(prefix="tiered_ckpt-agents-")
        os.environ.update(TIERED_CKPT_AGENT_DIR=folder, TIERED_CKPT_AGENT_IDLE=AGENT_IDLE)
        config._tiered_ckpt_agent_folder = folder  # type: ignore[attr-defined]
    config.addinivalue_line("markers", "slow: starts real processes (run after the quick subset; CI runs both)")


def pytest_unconfigure(config: pytest.Config) -> None:
    """No agent outlives the session: the one this process's tests started is stopped, its folder removed."""
    folder = getattr(config, "_tiered_ckpt_agent_folder", None)
    if folder is None:
        return
    from tiered_ckpt.testing.agents import stop_agent

    stop_agent(Path(folder))
    shutil.rmtree(folder, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(str(item.path))
        if path.parent.name in SLOW_FOLDERS or path.name in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def shm_dir():
    base = "/dev/shm" if Path("/dev/shm").is_dir() else None
    d = Path(tempfile.mkdtemp(prefix="tiered_ckpt-test-", dir=base))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def config_dict(tmp_path: Path, shm_dir: Path, **engine: Any) -> dict[str, Any]:
    # keep_last set: the memory tier is the staging buffer (the engine's default path with a memory tier)
    return stack_dict(tmp_path, {"kind": "memory", "capacity": "1GiB", "keep_last": 8}, "local", shm=shm_dir, **engine)


@pytest.fixture
def make_config(tmp_path, shm_dir) -> Callable[..., tc.Config]:
    """make_config(engine_key=value, ..., tiers=[...overrides per tier...]); a `{"kind": "faulty"}` override makes
    that tier inject faults, controlled by `tiered_ckpt.testing.configs.faults(config, name)`."""

    def make(tiers: list[dict[str, Any]] | None = None, **engine: Any) -> tc.Config:
        raw = config_dict(tmp_path, shm_dir, **engine)
        for i, extra in enumerate((tiers or [])[:len(raw["tiers"])]):  # {"kind": "faulty"} gets its control file
            raw["tiers"][i] = tier_table({**raw["tiers"][i], **extra}, tmp_path, shm_dir)
        return parse_config(raw)

    return make


@pytest.fixture
async def engine(make_config):
    async with tc.Engine(make_config()) as e:
        yield e


class RedisServer:
    """A real redis-server process on a free port; stop() kills it, start() brings it back empty on the same
    port (or fails clearly if something else took the port meanwhile)."""

    def __init__(self, tmp: Path, *args: str):
        self.tmp, self.args = tmp, args
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _argv(self, port: int) -> list[str]:
        return ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.tmp), *self.args]

    def start(self) -> "RedisServer":
        if self.port is None:
            self.proc, self.port = start_local_server(self._argv, timeout=10)
        else:  # a restart keeps the port: clients reconnect to the same URL
            self.proc, _ = start_local_server(self._argv, timeout=10, port=self.port)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    @contextlib.contextmanager
    def frozen(self) -> Iterator["RedisServer"]:
        """The server hung: stopped (SIGSTOP), its port open and nothing answering, until the block ends
        (SIGCONT, by its PID, unless it was killed meanwhile)."""
        proc = self.proc
        assert proc is not None and proc.poll() is None, "the server is not running"
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            yield self
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)


@pytest.fixture
def redis_server(tmp_path):
    """factory: redis_server(*extra_args) -> a started RedisServer, killed at teardown."""
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed; scripts/test.sh installs it")
    servers = []

    def start(*args: str) -> RedisServer:
        d = tmp_path / f"redis{len(servers)}"
        d.mkdir()
        servers.append(RedisServer(d, *args).start())
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory):
    """A real S3-compatible HTTP server (moto_server) on a free port, with test credentials in the
    environment (the standard AWS chain picks them up) for the session; the environment is restored after."""
    if shutil.which("moto_server") is None:
        pytest.fail("moto_server is not installed; scripts/test.sh installs moto[server]")
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    proc, port = start_local_server(lambda port: ["moto_server", "-H", "127.0.0.1", "-p", str(port)], log=log)
    credentials = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {name: os.environ.get(name) for name in credentials}
    os.environ.update(credentials)
    yield f"http://127.0.0.1:{port}"
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    proc.kill()
    proc.wait()


@pytest.fixture
def s3_bucket(s3_endpoint):
    """A fresh bucket on the test S3 server: (endpoint_url, bucket name)."""
    import uuid

    import boto3

    name = f"ckpt-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return s3_endpoint, name
