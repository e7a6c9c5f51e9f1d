"""Two simulated nodes x two ranks, each node with its own memory and disk tiers and a Redis peer cache
(two real redis-server processes). Node 1 loses its memory and disk; a fresh job restores node 1's
shards from its ring peer (node 1 wrote them to node 0's Redis), verified by checksum. The index is Redis
too, so the 4 ranks commit through its atomic script."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import tiered_ckpt as tc
from tiered_ckpt.testing.configs import stack

from .spawn import run_ranks

pytestmark = pytest.mark.timeout(300)  # real processes (gloo, torchrun): slower than unit tests


def node_config(root: str, node: int, urls: list[str]):
    """Per-node memory and disk; the peer caches on urls[0:2]; the Redis index on urls[2]."""
    base = Path(root) / f"node{node}"
    return stack(base, {"kind": "memory", "path": str(base / "shm")}, {"kind": "redis", "urls": urls[:2]}, "local",
                 job="nodes", index=urls[2])


def shard_state(rank: int, world: int, fill: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.arange(40_000 * world, dtype=torch.float32).reshape(world * 100, 400)
    mesh = init_device_mesh("cpu", (world,))
    return {"w": distribute_tensor(full if fill else torch.zeros_like(full), mesh, [Shard(0)])}


async def _save(rank: int, world: int, root: str, urls: list[str]) -> None:
    async with tc.Engine(node_config(root, rank // 2, urls)) as engine:
        await (await engine.save(1, shard_state(rank, world, True))).wait()


async def _load(rank: int, world: int, root: str, urls: list[str]) -> dict:
    target = shard_state(rank, world, False)
    async with tc.Engine(node_config(root, rank // 2, urls)) as engine:
        info = await engine.load(target)
    expected = torch.arange(40_000 * world, dtype=torch.float32).reshape(world * 100, 400)
    return {"ok": torch.equal(target["w"].full_tensor(), expected), "tier": info.tier,
            "by_tier": info.bytes_by_tier, "fallback_tiers": sorted({f.tier for f in info.fallbacks})}


def test_node_loss_restores_from_the_ring_peer(tmp_path, redis_server):
    urls = [redis_server().url, redis_server().url, redis_server().url]  # node 0, node 1, the index
    node_of = lambda rank: {"TIERED_CKPT_HOST": f"node{rank // 2}"}  # noqa: E731
    run_ranks(_save, 4, str(tmp_path), urls, env=node_of)
    for lost in ("shm", "disk"):
        shutil.rmtree(tmp_path / "node1" / lost)
    results = run_ranks(_load, 4, str(tmp_path), urls, env=node_of)
    assert all(r["ok"] for r in results)
    for rank in (0, 1):  # node 0 still has everything in memory
        assert results[rank]["tier"] == "host" and results[rank]["fallback_tiers"] == []
    for rank in (2, 3):  # node 1 lost memory and disk: its parts come from node 0's Redis
        assert results[rank]["tier"] == "peer" and set(results[rank]["by_tier"]) == {"peer"}
        assert results[rank]["fallback_tiers"] == []  # its node's memory holds none of them: not even tried
