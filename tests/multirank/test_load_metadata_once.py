"""A load's manifest and checksum records are read from the index once per world: rank 0 reads them and hands
them on with its pick; the other ranks make no index call for them (before: every rank read every rank's
record, R^2 reads per world). A damaged index record still falls back to a tier's copy."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tiered_ckpt as tc
from tiered_ckpt.testing.counting import CountingIndex

from .common import config
from .spawn import run_ranks

pytestmark = pytest.mark.timeout(300)  # real processes (gloo)


async def _save(rank: int, world: int, root: str) -> None:
    async with tc.Engine(config(root)) as engine:
        await (await engine.save(1, {"w": torch.arange(4.0), "r": tc.PerRank(torch.full((2,), float(rank)))})).wait()


async def _load(rank: int, world: int, root: str) -> dict:
    async with tc.Engine(config(root)) as engine:
        catalog = engine.store.catalog
        catalog.index = counting = CountingIndex(catalog.index)
        target = {"w": torch.zeros(4), "r": tc.PerRank(torch.zeros(2))}
        info = await engine.load(target)
    ok = torch.equal(target["w"], torch.arange(4.0)) and torch.equal(target["r"].value, torch.full((2,), float(rank)))
    return {"step": info.step, "ok": ok,
            "calls": dict(counting.calls)}


def test_only_rank_0_reads_the_manifest_and_records(tmp_path):
    root = str(tmp_path)
    run_ranks(_save, 4, root)
    # rank 0's copy of rank 2's record damaged in the index: the tier's copy is taken, and handed on
    (Path(root) / "index" / "dist" / "step-000000000001" / "ranks" / "2").write_bytes(b"\x00damaged")
    results = run_ranks(_load, 4, root)
    assert all(r["step"] == 1 and r["ok"] for r in results), results
    reads = ("get_manifest", "get_rank_meta", "get_rank_metas")
    assert sum(results[0]["calls"].get(m, 0) for m in reads) <= 3, results[0]["calls"]  # O(1), not O(R)
    for r in results[1:]:
        assert not any(r["calls"].get(m) for m in reads), r["calls"]
