"""The largest world this machine runs: 16 gloo ranks (tiny states, a memory and a disk tier, the file index),
through the public Engine API, so it exercises whatever save planner and load protocol are in place. DDP: saved
and loaded at 16, then loaded at 8. FSDP2 (fully_shard, one row of each layer a rank): saved at 16, loaded at 16
and resharded to 8. Model and AdamW state come back bit for bit, each checkpoint is read once in all, and no
rank sends or receives more than a few point-to-point messages."""
from __future__ import annotations

import pytest

from .spawn import run_ranks
from .worlds import load_counted, save_trained

pytestmark = pytest.mark.timeout(300)  # 16 real processes, then 8, on a small machine (~40 s on 2 cores)

KINDS = ("ddp", "fsdp")


async def _at_16(rank: int, world: int, root: str) -> dict:
    out = {}
    for kind in KINDS:
        saved = await save_trained(kind, world, root)
        out[kind] = await load_counted(kind, world, root, saved)
        out[kind]["saved"] = saved if rank == 0 else None
    return out


async def _at_8(rank: int, world: int, root: str, saved: dict) -> dict:
    return {kind: await load_counted(kind, world, root, saved[kind]) for kind in KINDS}


def check(results: list[dict], world: int) -> None:
    for kind in KINDS:
        got = [r[kind] for r in results]
        assert all(g["step"] == 1 and not g["wrong"] for g in got), (world, kind, [g["wrong"] for g in got])
        assert sum(g["read"] for g in got) == got[0]["nbytes"], (world, kind, [g["read"] for g in got])  # read once
        assert max(max(g["sends"], g["receives"]) for g in got) <= 3, (world, kind, got)


def test_ddp_and_fsdp2_at_16_ranks_resume_and_reshard_to_8(tmp_path):
    root = str(tmp_path)
    at_16 = run_ranks(_at_16, 16, root, timeout=600)
    check(at_16, 16)
    saved = {kind: at_16[0][kind]["saved"] for kind in KINDS}
    check(run_ranks(_at_8, 8, root, saved, timeout=300), 8)
