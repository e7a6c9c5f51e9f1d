"""A checkpoint saved at one layout loads bit-exactly into another (DTensor Shard/Replicate, 1-D and 2-D
meshes, uneven shards, other world sizes, no process group at all)."""
from __future__ import annotations

import asyncio

import pytest
import torch

import tiered_ckpt as tc

from .common import config
from .spawn import run_ranks

pytestmark = pytest.mark.timeout(300)  # real processes (gloo, torchrun): slower than unit tests


def full(name: str) -> torch.Tensor:
    shapes = {"w": (7, 5), "v": (6, 9), "b": (10,), "plain": (4, 3), "scalar": ()}
    n = 1
    for s in shapes[name]:
        n *= s
    base = {"w": 0.0, "v": 1000.0, "b": 2000.0, "plain": 3000.0, "scalar": 4000.0}[name]
    return (torch.arange(n, dtype=torch.float64) + base).reshape(shapes[name])


def placements(layout: str):
    from torch.distributed.tensor import Replicate, Shard

    return {
        "dp2xtp2": {"w": [Replicate(), Shard(0)], "v": [Shard(1), Shard(0)], "b": [Replicate(), Replicate()]},
        "shard4": {"w": [Shard(0)], "v": [Shard(1)], "b": [Shard(0)]},
        "shard3": {"w": [Shard(1)], "v": [Shard(0)], "b": [Shard(0)]},
        "replicate2": {"w": [Replicate()], "v": [Replicate()], "b": [Replicate()]},
        "replicate4": {"w": [Replicate()], "v": [Replicate()], "b": [Replicate()]},
    }[layout]


def mesh_for(layout: str, world: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2) if layout == "dp2xtp2" else (world,))


def state(layout: str, world: int, fill: bool) -> dict:
    from torch.distributed.tensor import distribute_tensor

    mesh = mesh_for(layout, world)
    out = {}
    for name, places in placements(layout).items():
        t = full(name) if fill else torch.zeros_like(full(name))
        out[name] = distribute_tensor(t, mesh, places)
    out["plain"] = full("plain") if fill else torch.zeros(4, 3, dtype=torch.float64)
    out["scalar"] = full("scalar") if fill else torch.zeros((), dtype=torch.float64)
    return out


async def _save(rank: int, world: int, root: str) -> None:
    async with tc.Engine(config(root)) as engine:
        await (await engine.save(1, state("dp2xtp2", world, True), metadata={"layout": "dp2xtp2"})).wait()


async def _load(rank: int, world: int, root: str, layout: str) -> dict:
    target = state(layout, world, False)
    async with tc.Engine(config(root)) as engine:
        info = await engine.load(target)
    ok = {}
    for name, t in target.items():
        value = t.full_tensor() if type(t).__name__ == "DTensor" else t
        ok[name] = torch.equal(value, full(name))
    return {"step": info.step, "ok": ok}


def test_dp2_tp2_checkpoint_loads_into_other_layouts(tmp_path):
    root = str(tmp_path)
    run_ranks(_save, 4, root)
    # TP=4, 3 ranks, DP=2, DP=4, and the saving layout itself; then one process without a group
    for layout, world in (("shard4", 4), ("shard3", 3), ("replicate2", 2), ("replicate4", 4), ("dp2xtp2", 4)):
        for result in run_ranks(_load, world, root, layout):
            assert result["step"] == 1 and all(result["ok"].values()), (layout, result)

    async def single_process() -> dict:
        target = {name: torch.zeros_like(full(name)) for name in ("w", "v", "b", "plain", "scalar")}
        async with tc.Engine(config(root)) as engine:  # no process group: world 1
            info = await engine.load(target)
            manifest = await engine.read_manifest(1)
        assert manifest.world_size == 4 and manifest.metadata == {"layout": "dp2xtp2"}
        return {name: torch.equal(t, full(name)) for name, t in target.items()} | {"step": info.step}

    result = asyncio.run(single_process())
    assert all(result.values()), result


async def _load_expecting_failure(rank: int, world: int, root: str) -> dict:
    target = state("shard4", world, False)
    async with tc.Engine(config(root)) as engine:
        try:
            await engine.load(target)
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}"}
    return {"error": None}


def test_a_part_its_reader_cannot_read_fails_every_rank_and_hangs_none(tmp_path):
    """Saved rank 1's part damaged on every tier: at another layout each loading rank wants byte spans of it,
    sent by the one rank that reads it. That reader finds no intact copy; the others, whose receives are already
    posted, get its word (and a payload they drop) instead of waiting forever; every rank raises, naming it."""
    root = str(tmp_path)
    run_ranks(_save, 4, root)
    damaged = sorted(p for p in tmp_path.rglob("part-*") if "rank-00001" in str(p) or "/1/" in str(p))
    assert damaged, sorted(str(p) for p in tmp_path.rglob("part-*"))
    for path in damaged:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    results = run_ranks(_load_expecting_failure, 4, root, timeout=60)
    errors = [r["error"] or "" for r in results]
    assert sum("rank-00001/part-000000: no tier returned it intact" in e for e in errors) == 1, errors  # the reader
    assert sum("part (1, 0): rank" in e and "its reader, found no intact copy" in e for e in errors) == 3, errors
