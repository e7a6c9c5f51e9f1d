"""A load's point-to-point messages per rank do not grow with the world. FSDP2: each rank's part holds a
replicated 0-d AdamW step beside its own shards, and every rank wants every step (a few bytes each); before,
each reader sent a status and a payload message to each other rank (6 sends a rank at 4 ranks, 14 at 8). DDP
(tiny): each rank reads 1/R of the state and every other rank wants it (the same). Small payloads now travel in
one buffer along a binary tree of ranks: at most 3 sends and 3 receives a rank, and the resumes are bit-exact."""
from __future__ import annotations

import pytest

import tiered_ckpt as tc

from .common import config
from .spawn import run_ranks
from .worlds import build, full_state, mismatches, train_step

pytestmark = pytest.mark.timeout(600)  # real processes (gloo): 4 and 8 of them


async def _save_and_load(rank: int, world: int, root: str) -> dict:
    out = {}
    for kind in ("ddp", "fsdp"):
        model, optim = build(kind, world)
        train_step(model, optim)
        saved = full_state(model, optim)
        async with tc.Engine(config(f"{root}/{kind}")) as engine:
            await (await engine.save(1, {"train": tc.TrainState(model, optim)})).wait()
        model, optim = build(kind, world)  # fresh: AdamW has no state yet
        async with tc.Engine(config(f"{root}/{kind}")) as engine:
            c = engine.coordinator
            before = (c.sends, c.receives)
            info = await engine.load({"train": tc.TrainState(model, optim)})
            sends, receives = c.sends - before[0], c.receives - before[1]
        out[kind] = {"step": info.step, "wrong": mismatches(full_state(model, optim), saved), "sends": sends,
                     "receives": receives, "read": sum(info.bytes_by_tier.values())}
    return out


def test_messages_per_rank_do_not_grow_with_the_world(tmp_path):
    counts = {}
    for world in (4, 8):
        results = run_ranks(_save_and_load, world, str(tmp_path / str(world)), timeout=400)
        for kind in ("ddp", "fsdp"):
            assert all(r[kind]["step"] == 1 and not r[kind]["wrong"] for r in results), (world, kind, results)
            counts[kind, world] = (max(r[kind]["sends"] for r in results), max(r[kind]["receives"] for r in results))
    for kind in ("ddp", "fsdp"):  # before: 6 sends a rank at 4 ranks, 14 at 8 (each reader to each other rank)
        assert max(counts[kind, 4]) <= 3 and max(counts[kind, 8]) <= 3, counts  # a tree: 2 at 4 ranks, 3 from 7 on
