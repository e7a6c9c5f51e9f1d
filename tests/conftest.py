"""Shared fixtures: a real on-disk config with a memory tier in /dev/shm and a local-disk tier."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import pytest

import tiered_ckpt as tc
from tiered_ckpt.config import parse_config


@pytest.fixture
def shm_dir():
    base = "/dev/shm" if Path("/dev/shm").is_dir() else None
    d = Path(tempfile.mkdtemp(prefix="tiered_ckpt-test-", dir=base))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def config_dict(tmp_path: Path, shm_dir: Path, **engine: Any) -> dict[str, Any]:
    return {
        "engine": {"job": "test", "index": f"file://{tmp_path}/index", "part_size": "64KiB", **engine},
        "tiers": [
            {"name": "host", "kind": "memory", "path": str(shm_dir / "host"), "capacity": "1GiB"},
            {"name": "disk", "kind": "local", "path": str(tmp_path / "disk")},
        ],
    }


@pytest.fixture
def make_config(tmp_path, shm_dir) -> Callable[..., tc.Config]:
    """make_config(engine_key=value, ..., tiers=[...overrides per tier...])"""

    def make(tiers: list[dict[str, Any]] | None = None, **engine: Any) -> tc.Config:
        raw = config_dict(tmp_path, shm_dir, **engine)
        for base, extra in zip(raw["tiers"], tiers or []):
            base.update(extra)
        return parse_config(raw)

    return make


@pytest.fixture
async def engine(make_config):
    async with tc.Engine(make_config()) as e:
        yield e


class RedisServer:
    """A real redis-server process on a free port; stop() kills it, start() brings it back empty."""

    def __init__(self, tmp: Path, *args: str):
        self.tmp, self.args = tmp, args
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "RedisServer":
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.tmp), *self.args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    environment (the standard AWS chain picks them up)."""
    if shutil.which("moto_server") is None:
        pytest.fail("moto_server is not installed; scripts/test.sh installs moto[server]")
    port = _free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    proc = subprocess.Popen(["moto_server", "-H", "127.0.0.1", "-p", str(port)], stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT)
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.1)
    else:
        proc.kill()
        raise RuntimeError(f"moto_server did not start: {log.read_text()[-2000:]}")
    yield f"http://127.0.0.1:{port}"
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
