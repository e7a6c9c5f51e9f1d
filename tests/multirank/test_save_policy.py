"""`should_save` with several ranks: every rank gets the same answer at the same step, for the time rule (rank
0's clock decides) and for a SIGTERM sent to one rank only (every rank saves that step, then every rank ends)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import time
from pathlib import Path

import pytest
import torch

import tiered_ckpt as tc

from .common import config
from .spawn import run_ranks

pytestmark = pytest.mark.timeout(300)  # real processes (gloo): slower than unit tests


async def _ask_with_rank_0_late(rank: int, world: int, root: str) -> dict:
    async with tc.Engine(config(root, save_every_seconds=0.2)) as engine:
        answers = {}
        for step in range(1, 7):
            if rank == 0 and step == 3:
                time.sleep(0.5)  # rank 0's clock passes the interval; rank 1 asks at once and waits for rank 0
            answers[step] = await engine.should_save(step)
            if answers[step]:
                await (await engine.save(step, {"w": torch.full((1000,), float(step))})).wait()
        return {"answers": answers, "collectives": engine.coordinator.collectives}


def test_the_time_rule_is_rank_0s_and_reaches_every_rank(tmp_path):
    """Rank 0 is late at step 3, past save_every_seconds; rank 1's own clock has not passed it. Both answer
    yes at step 3 (and alike at every step), and both save it."""
    results = run_ranks(_ask_with_rank_0_late, 2, str(tmp_path))
    assert results[0]["answers"] == results[1]["answers"], results
    assert results[0]["answers"][3] is True, results


async def _train_until_sigterm(rank: int, world: int, root: str, progress: str) -> None:
    Path(progress, f"pid{rank}").write_text(str(os.getpid()))
    async with tc.Engine(config(root, save_on_sigterm=True)) as engine:
        state = {"w": torch.zeros(5000), "rank": tc.PerRank(rank), "step": 0}
        for step in range(1, 1_000_000):
            state["w"] += 1.0
            state["step"] = step
            Path(progress, f"step{rank}").write_text(str(step))  # before asking: the last step each rank reached
            if await engine.should_save(step):
                await engine.save(step, state)
                Path(progress, f"returned{rank}").write_text(str(step))  # never: the process ends in save()
            await asyncio.sleep(0.001)  # a training step takes time; so the test's signal lands mid-run


def test_a_sigterm_to_one_rank_makes_every_rank_save_that_step_and_end(tmp_path):
    """SIGTERM from outside to rank 1 alone: at its next should_save every rank answers yes for the same step,
    saves it (complete on every tier, world size 2), and every rank then ends as SIGTERM would have ended it,
    none of them training on."""
    progress = tmp_path / "progress"
    progress.mkdir()
    exitcodes: dict[int, int | None] = {}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        ranks = pool.submit(run_ranks, _train_until_sigterm, 2, str(tmp_path), str(progress),
                            may_die=frozenset({0, 1}), exitcodes=exitcodes, timeout=240)
        deadline = time.monotonic() + 120
        while not ((progress / "step1").exists() and int((progress / "step1").read_text() or 0) >= 3):
            assert time.monotonic() < deadline and not ranks.done(), "rank 1 never reached step 3"
            time.sleep(0.01)
        os.kill(int((progress / "pid1").read_text()), signal.SIGTERM)
        ranks.result()
    assert exitcodes == {0: -signal.SIGTERM, 1: -signal.SIGTERM}, exitcodes
    last = [int((progress / f"step{r}").read_text()) for r in (0, 1)]
    assert last[0] == last[1] and not list(progress.glob("returned*")), (last, list(progress.iterdir()))

    async def listing() -> tuple[list, int, int]:
        async with tc.Engine(config(str(tmp_path))) as engine:  # one process: world 1
            statuses = [(c.step, sorted(c.complete)) async for c in engine.list()]
            manifest = await engine.read_manifest(statuses[-1][0])
            out = {"w": torch.zeros(5000), "step": -1}
            await engine.load(out)
            return statuses, manifest.world_size, int(out["w"][0])

    statuses, world, value = asyncio.run(listing())
    assert statuses == [(last[0], ["disk", "host"])] and world == 2 and value == last[0]
