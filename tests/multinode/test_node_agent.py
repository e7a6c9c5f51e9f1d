"""The node agent ([engine] agent = "on") on two emulated nodes (nodes.py), memory + peer ring + disk + S3, the index
in a Redis outside the nodes: a trainer that dies on one node right after its memory-tier commit, and an agent that
dies mid-drain there. Each ends with a bit-exact resume, and says which tier served each saved rank's bytes
(test_node_loss.expect)."""
from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest

from tiered_ckpt.agent.journal import Journal
from tiered_ckpt.storage.index import open_index
from tiered_ckpt.testing.faults import FaultControl

from .nodes import Cluster, namespaces_work
from .test_node_loss import WORKER, expect, job, write_config

pytestmark = pytest.mark.timeout(300)
JOB = "nodes"
EVERY_TIER = {"host", "peer", "disk", "s3"}


@pytest.fixture
def two_nodes(tmp_path: Path) -> Iterator[Cluster]:
    if (reason := namespaces_work()) is not None:
        pytest.skip(f"the kernel refuses namespaces: {reason}")
    nodes = Cluster.start(tmp_path / "cluster", 2)
    try:
        yield nodes
    finally:
        nodes.stop()


@pytest.fixture
def agent_dir() -> Iterator[Path]:
    """The agents' folders, one per node (agent_dir/<hostname>): short, for the socket's path (108 bytes at most)."""
    with tempfile.TemporaryDirectory(prefix="tca-") as d:
        yield Path(d)


def complete_on(index_url: str, step: int) -> set[str]:
    """The tiers the index lists `step` complete on (read from outside the nodes)."""
    async def ask() -> set[str]:
        index = open_index(index_url, timeout=5.0)
        await index.open()
        try:
            return next((set(s.complete) for s in await index.list(JOB) if s.step == step), set())
        finally:
            await index.close()
    return asyncio.run(ask())


def wait_until(predicate, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def also(results: list[dict], tiers: str) -> list[dict]:
    """The extra load over `tiers` of each rank (worker.py's also_tiers), shaped as a load's result."""
    return [{**r, **r["also"][tiers]} for r in results]


def test_a_trainer_killed_mid_drain_on_one_node_still_gets_its_disk_peer_and_s3_copies(
        two_nodes, redis_server, s3_bucket, agent_dir):
    """node1's trainer SIGKILLs itself right after step 2 committed on the memory tier, while
    node1's disk writes of step 2 are held: no process restarts, yet once the disk answers node1's agent
    finishes every copy and the index lists step 2 complete on host, peer, disk and S3 (node0's trainer, alive,
    sees every tier commit). The restarted job resumes step 2 from memory on both nodes; after node1 reboots
    (memory and its Redis wiped, disk kept) rank 1 comes from the peer ring (node0's Redis), and a load from disk
    alone and from S3 alone is bit-exact too."""
    cluster, index = two_nodes, redis_server().url
    faults = FaultControl(cluster.root / "faults.json")
    config = write_config(cluster, index, s3=s3_bucket, commit_timeout=40, disk_faults=cluster.root / "faults.json",
                          engine='agent = "on"')
    common = {"config": config, "agent_dir": str(agent_dir), "agent_idle": 3}
    faults.inject("stall", ops=["write"], hosts=["node1"], keys="step-000000000002")
    saving = cluster.start_job([sys.executable, WORKER], env_extra={"SPEC": json.dumps(
        {**common, "action": "save", "steps": [1, 2], "hard_exit": True,
         "faults": {"node1": "trainer:committed:host@2"}})})
    trainer1 = saving.ranks[1][1]
    trainer1.wait(timeout=120)
    assert trainer1.returncode != 0  # SIGKILLed at its fault point
    assert "fault point trainer:committed:host (step 2)" in saving.logs[1].read_text()
    wait_until(lambda: faults.stalled() >= 1, 90, "node1's agent never wrote step 2 to disk")
    assert complete_on(index, 2) <= {"host", "peer", "s3"}  # the disk copy is held, the trainer gone
    faults.clear()  # no restart: node1's agent finishes
    wait_until(lambda: complete_on(index, 2) == EVERY_TIER, 60, "step 2 did not complete on every tier")
    [survivor, dead] = saving.wait(timeout=120, may_fail=True)
    assert survivor["exitcode"] == 0 and survivor["steps"] == [1, 2], survivor
    assert dead["exitcode"] != 0 and not dead.get("steps")
    agent_log = (agent_dir / "node1" / "agent.log").read_text()
    for tier in ("peer", "disk", "s3"):  # node1's copies were made by node1's agent
        assert f"job nodes step 2 rank 1 on tier {tier}: done" in agent_log, agent_log

    resumed = job(cluster, **common, action="load")
    expect(resumed, 2, host=[0, 1])  # memory survived the trainer: both nodes read their own
    assert all(r["listing"]["2"] == sorted(EVERY_TIER) for r in resumed), [r["listing"] for r in resumed]

    cluster.nodes[1].reboot()  # node1's memory and Redis are gone, its disk is not
    after = job(cluster, **common, action="load", also_tiers=[["disk"], ["s3"]])
    expect(after, 2, host=[0], peer=[1])  # rank 1 from the ring: its copy is on node0's Redis
    expect(also(after, "disk"), 2, disk=[0, 1])
    expect(also(after, "s3"), 2, s3=[0, 1])
    print("trainer killed on node1: resume served host=[0, 1]; after node1's reboot host=[0], peer=[1]; "
          "disk alone: disk=[0, 1]; S3 alone: s3=[0, 1]")


def test_an_agent_killed_mid_drain_on_one_node_is_adopted_by_the_next_and_the_job_resumes(
        two_nodes, redis_server, s3_bucket, agent_dir):
    """The job dies right after step 2's memory-tier commit (every trainer SIGKILLed), and node1's agent dies
    (SIGKILL) once the first part of rank 1's disk copy is written: step 2 is not listed complete on disk (no half
    copy is visible) and the order waits in node1's journal. The restarted job's open starts a new agent on node1,
    which adopts the order and finishes it before the job goes on; the resume is step 2 from memory, bit-exact,
    every tier lists it complete, and a load from disk alone reads the adopted copy whole."""
    cluster, index = two_nodes, redis_server().url
    # commit_timeout: node0's agent waits that long for rank 1's disk copy before it records step 2 failed there;
    # past it, nothing is left to adopt (40 s was passed on a loaded CI machine before the restart came)
    config = write_config(cluster, index, s3=s3_bucket, commit_timeout=120, engine='agent = "on"')
    common = {"config": config, "agent_dir": str(agent_dir), "agent_idle": 3}
    crashed = cluster.run_job([sys.executable, WORKER], may_fail=True, timeout=180, env_extra={"SPEC": json.dumps(
        {**common, "action": "save", "steps": [1, 2], "hard_exit": True,
         "faults": {"node0": "trainer:committed:host@2",
                    "node1": "trainer:committed:host@2,agent:part-written:disk@2"}})})
    assert all(r["exitcode"] != 0 and not r.get("steps") for r in crashed), crashed
    node1 = agent_dir / "node1"
    wait_until(lambda: "fault point agent:part-written:disk (step 2)" in (node1 / "agent.log").read_text(), 30,
               "node1's agent did not die mid-drain")
    # accepted, not finished (step 1's may still be there too: its commits wait for rank 0's copies, and a loaded
    # machine may not have made them yet)
    assert 2 in {entry.order.step for entry in Journal(node1).pending()}
    assert "disk" not in complete_on(index, 2) and "host" in complete_on(index, 2)

    resumed = job(cluster, **common, action="load", also_tiers=[["disk"]])
    assert "agent: adopting job nodes step 2 rank 1" in (node1 / "agent.log").read_text()
    assert not list((node1 / "journal").glob("*.order"))
    expect(resumed, 2, host=[0, 1])
    assert all(r["listing"]["2"] == sorted(EVERY_TIER) for r in resumed), [r["listing"] for r in resumed]
    expect(also(resumed, "disk"), 2, disk=[0, 1])
    print("agent killed on node1: adopted at the restart; resume served host=[0, 1]; disk alone: disk=[0, 1]")
