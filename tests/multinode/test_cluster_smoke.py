"""Three emulated nodes (tests/multinode/nodes.py: Linux namespaces, each with its own hostname, /dev/shm,
disk and peer redis-server) save a checkpoint through host memory, the Redis peer ring and local disk,
with the index in a Redis outside the nodes; a new job on the same nodes loads it back exactly."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Iterator

import pytest

from .nodes import Cluster, namespaces_work

pytestmark = pytest.mark.timeout(300)  # real processes: namespaces, redis-servers, gloo worlds
WORKER = str(Path(__file__).with_name("worker.py"))


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    if (reason := namespaces_work()) is not None:
        pytest.skip(f"the kernel refuses namespaces: {reason}")
    nodes = Cluster.start(tmp_path / "cluster", 3)
    try:
        yield nodes
    finally:
        nodes.stop()


def write_config(cluster: Cluster, index_url: str) -> Path:
    """The stack of tiers/cluster.toml, scaled down: /dev/shm of each node, the peer ring, the common disk path."""
    urls = ", ".join(json.dumps(url) for url in cluster.peer_urls)
    path = cluster.root / "tiers.toml"
    path.write_text(f"""\
[engine]
job = "smoke"
index = "{index_url}"
part_size = "16KiB"

[[tiers]]
name = "host"
kind = "memory"
capacity = "256MiB"
keep_last = 2

[[tiers]]
name = "peer"
kind = "redis"
urls = [{urls}]

[[tiers]]
name = "disk"
kind = "local"
path = "{cluster.root / 'local' / 'ckpt'}"
""")
    return path


def job(cluster: Cluster, **spec: object) -> list[dict]:
    return cluster.run_job([sys.executable, WORKER], env_extra={"SPEC": json.dumps(spec)})


def test_save_on_three_nodes_and_load_back(cluster, redis_server):
    config = str(write_config(cluster, redis_server().url))
    saved = job(cluster, config=config, action="save", steps=[1, 2])
    assert [r["hostname"] for r in saved] == ["node0", "node1", "node2"]
    loaded = job(cluster, config=config, action="load")
    for r in loaded:
        print(f"rank {r['rank']} on {r['node']}: tier {r['tier']}, bytes_by_tier {r['bytes_by_tier']}, "
              f"fallbacks {r['fallbacks']}, bytes_received {r['bytes_received']}")
    assert [(r["error"], r["step"], r["exact"]) for r in loaded] == [(None, 2, True)] * 3
