"""A plan miss on real gloo ranks: descriptors go to rank 0 alone and each rank gets its share back. A rank that
fails before planning (describing its state, or its state_dict() already) makes every rank raise RankFailed
naming it; a state rank 0 cannot plan (a tensor whose shape differs between ranks) raises StateError on every
rank; after either, the next plan's collectives still line up. A hit runs no collective."""
from __future__ import annotations

import pytest
import torch

from tiered_ckpt.distributed.coordinator import Coordinator
from tiered_ckpt.save.plan import Planner

from .spawn import run_ranks

pytestmark = pytest.mark.timeout(300)  # real processes (gloo): slower than unit tests


async def _exchange(rank: int, world: int, case: str) -> dict:
    coordinator = await Coordinator.create(60)
    planner = Planner(1 << 20, coordinator)
    good = [torch.ones(1000), torch.ones(4, 3) * rank]
    paths = ["w", f"rng@rank{rank}"]
    outcome = "planned"
    try:
        if case == "shape":
            await planner.plan(paths, [torch.ones(1000 + (rank == 1)), good[1]])
        elif case == "describe" and rank == 1:
            planner._describe = _refuse  # type: ignore[method-assign]
            await planner.plan(paths, good)
        elif case == "join" and rank == 2:
            await planner.join_failed(ValueError("state_dict() raised"))
            outcome = "returned"
        else:
            await planner.plan(paths, good)
    except Exception as e:
        outcome = f"{type(e).__name__}: {e}"
    if case == "describe" and rank == 1:
        del planner._describe
    plan = await planner.plan(["v", *paths], [torch.ones(64), *good])  # a miss after the failure, on every rank
    before = coordinator.collectives
    again = await planner.plan(["v", *paths], [torch.ones(64), *good])
    await coordinator.destroy()
    return {"outcome": outcome, "holds_world": plan.tensors is not None, "own": len(plan.local),
            "hit_collectives": coordinator.collectives - before, "same": again is plan,
            "chunks": None if plan.tensors is None else sorted((t.path, c.rank) for t in plan.tensors for c in t.chunks)}


def _refuse(paths: list, tensors: list) -> None:
    raise ValueError("a value that cannot be saved")


@pytest.mark.parametrize("case", ["describe", "join", "shape"])
def test_a_failure_before_or_in_planning_raises_on_every_rank_and_the_next_plan_still_works(case):
    results = run_ranks(_exchange, 3, case, timeout=240)
    expected = {"describe": "RankFailed: rank 1 failed before the save was planned: ValueError: a value that "
                            "cannot be saved",
                "join": "RankFailed: rank 2 failed before the save was planned: ValueError: state_dict() raised",
                "shape": "StateError: tensor 'w' is torch.float32 [1000] on one rank but torch.float32 [1001] on "
                         "rank 1"}[case]
    assert [r["outcome"] for r in results] == [expected] * 3
    for rank, r in enumerate(results):
        assert r["holds_world"] == (rank == 0) and r["hit_collectives"] == 0 and r["same"]
        assert r["own"] >= 1  # its own rng state at least
    chunks = results[0]["chunks"]
    assert [c for c in chunks if c[0].startswith("rng@")] == [(f"rng@rank{r}", r) for r in range(3)]
    assert sum(1 for c in chunks if c[0] == "w") >= 1 and sum(r["own"] for r in results) == len(chunks)
