"""Fixtures for tests against real Redis deployments (import them into a test module):

- `redis_cluster`: a Redis Cluster of 3 masters (`redis-cli --cluster create`), one per module;
  `cluster_url` empties it (FLUSHALL on every master) and returns its redis+cluster:// URL.
- `sentinel_deployment`: a master, one replica and one sentinel (quorum 1, 1 s down-after), started
  fresh for each test (a failover test leaves it changed).
"""
from __future__ import annotations

import shutil
import subprocess

import pytest

from tiered_ckpt.testing.redis_local import LocalCluster, LocalSentinel

__all__ = ["redis_cluster", "cluster_url", "sentinel_deployment", "flush"]


def _need_redis() -> None:
    for tool in ("redis-server", "redis-cli"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is not installed; scripts/test.sh installs it")


def flush(port: int) -> None:
    subprocess.run(["redis-cli", "-p", str(port), "flushall"], check=True, capture_output=True, timeout=10)


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    _need_redis()
    cluster = LocalCluster(3, node_timeout_ms=1000, base=tmp_path_factory.mktemp("cluster"))
    yield cluster
    cluster.stop()


@pytest.fixture
def cluster_url(redis_cluster) -> str:
    for node in redis_cluster.nodes:
        if node.alive:
            flush(node.port)
    return redis_cluster.url


@pytest.fixture
def sentinel_deployment(tmp_path):
    _need_redis()
    deployment = LocalSentinel(replicas=1, down_after_ms=1000, failover_timeout_ms=2000, base=tmp_path)
    yield deployment
    deployment.stop()
