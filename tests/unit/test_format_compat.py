"""Checkpoints written by earlier releases (formats 1 and 2: no incarnation folders; format 1 also unsealed
records and one skeleton) still list, load, verify and delete. tests/data/format1 and format2 were saved by
those releases (see the state below)."""
import shutil
from pathlib import Path

import pytest
import torch

import tiered_ckpt as tc
from tiered_ckpt.testing.configs import stack
from tiered_ckpt.load.verify import verify

DATA = Path(__file__).parent.parent / "data"


def saved_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(40_000, generator=g), "b": torch.arange(10, dtype=torch.int64), "extra": {"lr": 0.5}}


@pytest.fixture(params=[1, 2])
def old_checkpoint(tmp_path, request):
    root = tmp_path / f"format{request.param}"
    shutil.copytree(DATA / f"format{request.param}", root)
    return root


def config(root: Path, **engine) -> tc.Config:
    return stack(root, "local", job="old", **engine)


def zeros() -> dict:
    return {"w": torch.zeros(40_000), "b": torch.zeros(10, dtype=torch.int64), "extra": {"lr": None}}


async def test_an_old_format_checkpoint_loads_verifies_and_deletes(old_checkpoint):
    async with tc.Engine(config(old_checkpoint)) as engine:
        out = zeros()
        info = await engine.load(out)
        expected = saved_state()
        assert info.step == 3 and torch.equal(out["w"], expected["w"]) and torch.equal(out["b"], expected["b"])
        assert out["extra"] == {"lr": 0.5}
        manifest = await engine.read_manifest(3)
        assert manifest.version == int(old_checkpoint.name[-1]) and manifest.incarnation == ""
        assert all(r.ok for r in await verify(engine.store.io, await engine.status(3), manifest))
        await (await engine.save(4, saved_state())).wait()  # new saves beside it use the new layout
        await engine.delete(3)
        assert not [k for k in await engine.store.io.driver("disk").list("old/") if "step-000000000003" in k]
        assert [c.step async for c in engine.list()] == [4]


async def test_an_old_format_checkpoint_loads_from_the_tier_alone(old_checkpoint):
    shutil.rmtree(old_checkpoint / "index")
    async with tc.Engine(config(old_checkpoint, adopt=True)) as engine:  # it names the old index (format 2) or none (1)
        out = zeros()
        assert (await engine.load(out)).step == 3 and torch.equal(out["w"], saved_state()["w"])


async def test_a_format_3_checkpoint_loads_and_verifies_without_chunk_digests(tmp_path):
    """tests/data/format3 was saved by the release before chunk digests (format 3: incarnation folders, one
    checksum per part). It loads (each part read whole and verified), verifies, and a new save beside it is
    format 4. (Moved here, its file index is another index by identity: its folder stays for gc.)"""
    root = tmp_path / "format3"
    shutil.copytree(DATA / "format3", root)
    async with tc.Engine(config(root)) as engine:
        out = zeros()
        assert (await engine.load(out)).step == 3
        assert torch.equal(out["w"], saved_state()["w"]) and out["extra"] == {"lr": 0.5}
        manifest = await engine.read_manifest(3)
        assert manifest.version == 3 and manifest.chunk_size == 0 and manifest.incarnation
        assert all(r.ok for r in await verify(engine.store.io, await engine.status(3), manifest))
        await (await engine.save(4, saved_state())).wait()
        new = await engine.read_manifest(4)
        assert new.version == 4 and new.chunk_size == 64 * 1024 and len(new.ranks[0].chunk_sums) == 3 * 8
        out = zeros()
        assert (await engine.load(out)).step == 4 and torch.equal(out["w"], saved_state()["w"])
