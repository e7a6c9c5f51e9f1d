"""Nodes as they really fail, on three emulated nodes (tests/multinode/nodes.py: each its own hostname,
/dev/shm, disk and peer redis-server; the index in a Redis outside them, S3 a moto_server): a node lost is
every process of it SIGKILLed, its memory and disk gone, its Redis gone; it comes back empty.

Each test asserts, bit-exact against the state of the saved step, which tier served which saved rank's bytes
(the sum over the ranks of LoadInfo.bytes_by_tier, against every saved rank's size): nothing is read from a
slower tier while a node's memory or the peer ring still holds it.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import redis

from .nodes import Cluster, namespaces_work

pytestmark = pytest.mark.timeout(600)  # real processes: namespaces, redis-servers, gloo worlds
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


def write_config(cluster: Cluster, index_url: str, *, s3: tuple[str, str] | None = None, heal: bool = True,
                 commit_timeout: float = 60, disk_faults: Path | None = None, engine: str = "",
                 peer: str = "") -> str:
    """tiers/cluster.toml scaled down: each node's /dev/shm, the peer ring (urls named by host), the disk path
    every node has; optionally S3. `disk_faults`: the disk is a `faulty` tier commanded by that control file;
    `engine`, `peer`: more TOML lines for those tables. The ring's PING probe gets 5 s unless `peer` says
    (the default 1 s is short on a loaded 2-core machine: a slow answer passes the server over, and the copy lands
    on the next server in the ring, not where these tests look for it)."""
    if "probe_timeout" not in peer:
        peer = f"probe_timeout = 5.0\n{peer}"
    urls = ", ".join(json.dumps(url) for url in cluster.peer_urls)
    path = cluster.root / "tiers.toml"
    text = f"""\
[engine]
job = "nodes"
index = "{index_url}"
part_size = "16KiB"
heal = {str(heal).lower()}
commit_timeout = {commit_timeout}
collective_timeout = 60
{engine}

[[tiers]]
name = "host"
kind = "memory"
capacity = "256MiB"
keep_last = 2

[[tiers]]
name = "peer"
kind = "redis"
urls = [{urls}]
down_seconds = 5
{peer}

[[tiers]]
name = "disk"
kind = "{'local' if disk_faults is None else 'faulty'}"
path = "{cluster.root / 'local' / 'ckpt'}"
"""
    if disk_faults is not None:
        text += f'control = "{disk_faults}"\n'
    if s3 is not None:
        text += f'\n[[tiers]]\nname = "s3"\nkind = "s3"\nbucket = "{s3[1]}"\nendpoint_url = "{s3[0]}"\n'
    path.write_text(text)
    return str(path)


def job(cluster: Cluster, order: list[int] | None = None, **spec: Any) -> list[dict]:
    return cluster.run_job([sys.executable, WORKER], order, env_extra={"SPEC": json.dumps(spec)}, timeout=240)


def served(results: list[dict]) -> dict[str, int]:
    """Bytes each tier served, all ranks together."""
    total: dict[str, int] = {}
    for r in results:
        for tier, n in r["bytes_by_tier"].items():
            total[tier] = total.get(tier, 0) + n
    return total


def expect(results: list[dict], step: int, **by_tier: list[int]) -> None:
    """Every rank loaded `step` bit-exact, with no fallback, and the tiers served exactly the saved ranks
    given: expect(r, 2, host=[0, 2], peer=[1]) means saved ranks 0 and 2 from host, 1 from the peer ring."""
    assert [(r["error"], r.get("step"), r["exact"]) for r in results] == [(None, step, True)] * len(results), results
    assert all(r["fallbacks"] == [] for r in results), [r["fallbacks"] for r in results]
    sizes = results[0]["rank_nbytes"]
    assert served(results) == {t: sum(sizes[r] for r in ranks) for t, ranks in by_tier.items()}, \
        [(r["rank"], r["node"], r["bytes_by_tier"]) for r in results]


def relaunch(cluster: Cluster, *nodes: int) -> None:
    for n in nodes:
        cluster.nodes[n].kill()
    for n in nodes:
        cluster.nodes[n].start()


def test_one_node_lost_resumes_from_memory_and_the_ring_then_heals_for_the_next_loss(cluster, redis_server):
    config = write_config(cluster, redis_server().url)
    job(cluster, config=config, action="save", steps=[1, 2])
    # every node healthy: a tier whole across the nodes serves a load alone
    expect(job(cluster, config=config, action="load", tiers=["host"]), 2, host=[0, 1, 2])
    expect(job(cluster, config=config, action="load", tiers=["disk"]), 2, disk=[0, 1, 2])

    relaunch(cluster, 1)  # node1's memory, disk and Redis (node0's peer copies) are gone
    partial = job(cluster, config=config, action="load", tiers=["peer"])  # not lost: not on the tiers asked for
    assert all(r["error"].startswith("IncompleteCheckpoint: ") and "rank(s) [0]" in r["error"] for r in partial)
    loaded = job(cluster, config=config, action="load")
    expect(loaded, 2, host=[0, 2], peer=[1])  # nothing from disk: memory and the ring hold every part
    parts = [-(-n // 16384) for n in loaded[0]["rank_nbytes"]]  # part_size 16 KiB
    # in the background: rank 1's memory copy from the ring, rank 0's ring copy to node1's new Redis
    assert [r["healed"] for r in loaded] == [{"peer": parts[0]}, {"host": parts[1]}, {}]

    relaunch(cluster, 2)  # a second loss right after: the healed copies carry it
    expect(job(cluster, config=config, action="load"), 2, host=[0, 1], peer=[2])


def test_two_adjacent_nodes_lost_read_from_s3_only_what_they_took_and_then_nothing_is_lost_silently(
        cluster, redis_server, s3_bucket):
    import boto3

    config = write_config(cluster, redis_server().url, s3=s3_bucket, heal=False)
    job(cluster, config=config, action="save", steps=[1])
    relaunch(cluster, 1, 2)  # rank 1: memory, disk and its ring copy (on node2) gone; rank 2's ring copy is on node0
    expect(job(cluster, config=config, action="load"), 1, host=[0], peer=[2], s3=[1])

    bucket = boto3.resource("s3", endpoint_url=s3_bucket[0], region_name="us-east-1").Bucket(s3_bucket[1])
    bucket.objects.all().delete()  # now rank 1's parts are nowhere
    lost = job(cluster, config=config, action="load")
    assert all(r["error"].startswith("CheckpointLost: ") and "rank(s) [1]" in r["error"] for r in lost), lost


def test_the_ring_follows_machines_after_a_shuffled_restart(cluster, redis_server):
    index = redis_server().url
    config = write_config(cluster, index)
    saved = job(cluster, [0, 2, 1], config=config, action="save", steps=[1])  # node2 is group 1, node1 group 2
    assert [r["save_errors"] for r in saved] == [{}] * 3, saved
    machine_of = {r["rank"]: r["hostname"] for r in saved}
    assert machine_of == {0: "node0", 1: "node2", 2: "node1"}
    for i, node in enumerate(cluster.nodes):  # each server holds the records of its ring predecessor's ranks
        keys = redis.Redis(node.ip, cluster.redis_port).keys("*checksums.msgpack")
        ranks = {int(k.decode().split("/rank-")[1][:5]) for k in keys}
        assert {machine_of[r] for r in ranks} == {f"node{(i - 1) % 3}"}, (node.name, ranks)

    relaunch(cluster, 2)  # rank 1's machine: its memory gone, its ring copy safe on node0
    loaded = job(cluster, [0, 1, 2], config=config, action="load")  # and the ranks land on other machines
    expect(loaded, 1, host=[0, 2], peer=[1])  # rank 2's shard is read on node1, which holds it, not from disk


def test_heals_after_a_shuffled_restart_put_each_copy_back_where_its_writer_keeps_it(cluster, redis_server):
    """Saved with ranks on machines [2, 0, 1]; node1 replaced; loaded on [0, 1, 2]: each saved rank's lost copy
    is rewritten by a rank on the machine that wrote it (its memory copy there, its ring copy on that machine's
    successor), never beside its other copy, so losing another node right after still loses nothing."""
    config = write_config(cluster, redis_server().url)
    saved = job(cluster, [2, 0, 1], config=config, action="save", steps=[1])  # saved rank r ran on node [2, 0, 1][r]
    assert [r["save_errors"] for r in saved] == [{}] * 3, saved
    relaunch(cluster, 1)  # saved rank 2's memory copy and saved rank 1's ring copy (node0's writes) are gone
    loaded = job(cluster, [0, 1, 2], config=config, action="load")
    expect(loaded, 1, host=[0, 1], peer=[2])
    parts = [-(-n // 16384) for n in loaded[0]["rank_nbytes"]]
    # rank 0 runs on node0, saved rank 1's machine: its ring copy; rank 1 on node1: saved rank 2's memory copy
    assert [r["healed"] for r in loaded] == [{"peer": parts[1]}, {"host": parts[2]}, {}]
    relaunch(cluster, 0)
    expect(job(cluster, [0, 1, 2], config=config, action="load"), 1, host=[0, 2], peer=[1])


def test_a_stale_three_node_file_on_two_nodes_resumes_and_keeps_saving(cluster, redis_server):
    config = write_config(cluster, redis_server().url)
    job(cluster, config=config, action="save", steps=[1, 2])
    cluster.nodes[2].kill()  # gone for good: the job goes on with 2 nodes and the same file (3 urls)
    loaded = job(cluster, [0, 1], config=config, action="load", steps=[3, 4])
    expect(loaded, 2, host=[0, 1], peer=[2])  # elastic 3 -> 2: resharded, rank 2's parts from node0's Redis
    assert [r["saved"] for r in loaded] == [[3, 4], [3, 4]]  # node1's ring successor is dead: passed over
    expect(job(cluster, [0, 1], config=config, action="load"), 4, host=[0, 1])


def test_a_node_lost_mid_save_resumes_the_newest_complete_step_and_survivors_exit(cluster, redis_server):
    config = write_config(cluster, redis_server().url, commit_timeout=10)
    progress = cluster.root / "progress"
    running = cluster.start_job([sys.executable, WORKER], env_extra={"SPEC": json.dumps(
        {"config": config, "action": "train", "first": 1, "progress": str(progress)})})
    deadline = time.monotonic() + 120
    while not Path(f"{progress}.0").exists() or int(Path(f"{progress}.0").read_text()) < 2:
        assert time.monotonic() < deadline, "the job saved nothing in 120 s"
        time.sleep(0.05)
    cluster.nodes[1].kill()
    killed = time.time()
    survivors = [r for r in running.wait(timeout=240, may_fail=True) if r["node"] != "node1"]
    exits = [r["ended"] - killed for r in survivors]
    print(f"survivors' save failed {exits} s after the node was killed (commit_timeout 10 s)")
    assert all(r["error"] for r in survivors) and max(exits) < 10 + 30
    done = max(int(Path(f"{progress}.{r}").read_text()) for r in (0, 2))

    cluster.nodes[1].start()
    loaded = job(cluster, config=config, action="load")
    assert loaded[0]["step"] >= done
    expect(loaded, loaded[0]["step"], host=[0, 2], peer=[1])
