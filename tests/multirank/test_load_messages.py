"""A load's point-to-point messages per rank do not grow with the world. FSDP2: each rank's part holds a
replicated 0-d AdamW step beside its own shards, and every rank wants every step (a few bytes each); before,
each reader sent a status and a payload message to each other rank (6 sends a rank at 4 ranks, 14 at 8). DDP
(tiny): each rank reads 1/R of the state and every other rank wants it (the same). Small payloads now travel in
one buffer along a binary tree of ranks: at most 3 sends and 3 receives a rank, and the resumes are bit-exact."""
from __future__ import annotations

import pytest

from .spawn import run_ranks
from .worlds import load_counted, save_trained

pytestmark = pytest.mark.timeout(600)  # real processes (gloo): 4 and 8 of them


async def _save_and_load(rank: int, world: int, root: str) -> dict:
    return {kind: await load_counted(kind, world, root, await save_trained(kind, world, root))
            for kind in ("ddp", "fsdp")}


def test_messages_per_rank_do_not_grow_with_the_world(tmp_path):
    counts = {}
    for world in (4, 8):
        results = run_ranks(_save_and_load, world, str(tmp_path / str(world)), timeout=400)
        for kind in ("ddp", "fsdp"):
            assert all(r[kind]["step"] == 1 and not r[kind]["wrong"] for r in results), (world, kind, results)
            counts[kind, world] = (max(r[kind]["sends"] for r in results), max(r[kind]["receives"] for r in results))
    for kind in ("ddp", "fsdp"):  # before: 6 sends a rank at 4 ranks, 14 at 8 (each reader to each other rank)
        assert max(counts[kind, 4]) <= 3 and max(counts[kind, 8]) <= 3, counts  # a tree: 2 at 4 ranks, 3 from 7 on
