"""S3 alone restores across world sizes: 2 ranks save to S3 (and a file index), 3 ranks on a 'fresh
machine' (an empty index, only the S3 tier) find the newest complete checkpoint on S3 and reshard it."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tiered_ckpt as tc
from tiered_ckpt.testing.configs import stack

from .spawn import run_ranks

pytestmark = pytest.mark.timeout(300)  # real processes (gloo, torchrun): slower than unit tests


def s3_only(index: Path, endpoint: str, bucket: str):
    return stack(index.parent, {"kind": "s3", "bucket": bucket, "endpoint_url": endpoint}, job="s3dist",
                 index=f"file://{index}", adopt=True)


def sharded(world: int, fill: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.arange(30 * 70, dtype=torch.float32).reshape(30, 70)
    return {"w": distribute_tensor(full if fill else torch.zeros_like(full), init_device_mesh("cpu", (world,)),
                                   [Shard(1)]), "replicated": full[0].clone() if fill else torch.zeros(70)}


async def _save(rank: int, world: int, index: str, endpoint: str, bucket: str) -> None:
    async with tc.Engine(s3_only(Path(index), endpoint, bucket)) as engine:
        for step in (1, 2):
            await (await engine.save(step, sharded(world, True))).wait()


async def _load(rank: int, world: int, index: str, endpoint: str, bucket: str) -> dict:
    target = sharded(world, False)
    async with tc.Engine(s3_only(Path(index), endpoint, bucket)) as engine:
        info = await engine.load(target)
    full = torch.arange(30 * 70, dtype=torch.float32).reshape(30, 70)
    return {"step": info.step, "tier": info.tier, "ok": torch.equal(target["w"].full_tensor(), full)
            and torch.equal(target["replicated"], full[0])}


def test_two_ranks_save_to_s3_three_ranks_restore_from_s3_alone(tmp_path, s3_bucket):
    endpoint, bucket = s3_bucket
    run_ranks(_save, 2, str(tmp_path / "index"), endpoint, bucket)
    for result in run_ranks(_load, 3, str(tmp_path / "fresh-index"), endpoint, bucket):
        assert result == {"step": 2, "tier": "s3", "ok": True}
