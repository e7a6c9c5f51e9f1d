"""State that differs between ranks: keys held by one rank only, per-rank plain values, tc.PerRank entries,
and failures on one rank. Every rank enters the same collectives in the same order whatever its state, and
every rank raises the same error when one fails."""
from __future__ import annotations

import time

import pytest
import torch

import tiered_ckpt as tc

from .common import config
from .spawn import run_ranks

pytestmark = pytest.mark.timeout(300)  # real processes (gloo, torchrun): slower than unit tests


def rank_state(rank: int, fill: bool) -> dict:
    """A key only this rank holds, a replicated tensor, and plain values that differ per rank."""
    value = float(rank + 1) if fill else 0.0
    return {f"k{rank}": torch.full((3000 + rank,), value), "common": torch.full((2000,), 7.0 if fill else 0.0),
            "meta": {"rank": rank if fill else -1, "lrs": [0.1 * (rank + 1)] if fill else []}}


async def _save_rank_state(rank: int, world: int, root: str) -> None:
    async with tc.Engine(config(root)) as engine:
        state = rank_state(rank, True)
        state["rng"] = tc.PerRank(torch.full((5,), 100.0 + rank))
        state["loader"] = tc.PerRank({"position": 1000 * rank})
        await (await engine.save(1, state)).wait()


async def _load_same_world(rank: int, world: int, root: str) -> dict:
    async with tc.Engine(config(root)) as engine:
        state = rank_state(rank, False)
        state["rng"] = tc.PerRank(torch.zeros(5))
        state["loader"] = tc.PerRank({"position": -1})
        info = await engine.load(state)
        return {"step": info.step, "own": state[f"k{rank}"].tolist()[:2], "common": state["common"][0].item(),
                "meta": state["meta"], "rng": state["rng"].value.tolist(), "loader": state["loader"].value}


def test_rank_specific_keys_and_values_round_trip_at_the_same_world_size(tmp_path):
    run_ranks(_save_rank_state, 2, str(tmp_path))
    results = run_ranks(_load_same_world, 2, str(tmp_path))
    for rank, r in enumerate(results):
        assert r["step"] == 1 and r["own"] == [float(rank + 1)] * 2 and r["common"] == 7.0
        assert r["meta"] == {"rank": rank, "lrs": [0.1 * (rank + 1)]}  # each rank's own plain values
        assert r["rng"] == [100.0 + rank] * 5 and r["loader"] == {"position": 1000 * rank}


async def _load_all_keys_on_one_rank(rank: int, world: int, root: str) -> dict:
    async with tc.Engine(config(root)) as engine:
        state = {"k0": torch.zeros(3000), "k1": torch.zeros(3001), "common": torch.zeros(2000)}
        await engine.load(state)
        return {k: v.unique().tolist() for k, v in state.items()}


async def _load_at_three(rank: int, world: int, root: str) -> dict:
    async with tc.Engine(config(root)) as engine:
        state = {"common": torch.zeros(2000), "meta": {}}
        if rank < 2:
            state[f"k{rank}"] = torch.zeros(3000 + rank)
        info = await engine.load(state)
        return {"keys": sorted(state), "common": state["common"].unique().tolist(), "meta": state["meta"],
                "read": info.bytes_by_tier}


def test_rank_specific_keys_load_at_other_world_sizes(tmp_path):
    run_ranks(_save_rank_state, 2, str(tmp_path))
    [one] = run_ranks(_load_all_keys_on_one_rank, 1, str(tmp_path))
    assert one == {"k0": [1.0], "k1": [2.0], "common": [7.0]}
    three = run_ranks(_load_at_three, 3, str(tmp_path))
    assert [r["common"] for r in three] == [[7.0]] * 3
    assert [r["meta"] for r in three] == [{"rank": 0, "lrs": [0.1]}, {"rank": 1, "lrs": [0.2]},
                                          {"rank": 0, "lrs": [0.1]}]  # a rank that did not exist gets rank 0's


async def _per_rank_entry_for_a_new_rank(rank: int, world: int, root: str) -> str:
    async with tc.Engine(config(root)) as engine:
        state = {"common": torch.zeros(2000), "rng": tc.PerRank(torch.zeros(5))}
        with pytest.raises(tc.TieredCkptError) as err:
            await engine.load(state)
        assert torch.all(state["common"] == 0)  # nothing was written on any rank
        return str(err.value)


def test_a_per_rank_entry_that_the_saved_world_lacks_fails_on_every_rank(tmp_path):
    run_ranks(_save_rank_state, 2, str(tmp_path))
    errors = run_ranks(_per_rank_entry_for_a_new_rank, 3, str(tmp_path))
    assert all("rank 2" in e and "'rng'" in e and "saved by 2 ranks" in e for e in errors), errors


async def _per_rank_entries_with_a_policy_for_new_ranks(rank: int, world: int, root: str) -> dict:
    """Two loads at 3 ranks of a 2-rank checkpoint: the tensor entry derived from every saved rank's, the plain
    entry kept (first load) or derived (second)."""
    def newest_position(saved: list) -> dict:
        assert len(saved) == 2
        return {"position": max(s["position"] for s in saved)}

    async with tc.Engine(config(root)) as engine:
        out = {}
        for loader_missing in ("keep", newest_position):
            state = {"common": torch.zeros(2000),
                     "rng": tc.PerRank(torch.zeros(5), missing=lambda saved: saved[0] + saved[1]),
                     "loader": tc.PerRank({"position": -1}, missing=loader_missing)}
            assert (await engine.load(state)).step == 1
            out[str(loader_missing == "keep")] = {"rng": state["rng"].value.tolist(), "loader": state["loader"].value,
                                                  "common": state["common"].unique().tolist()}
        return out


def test_per_rank_entries_load_at_a_larger_world_size_by_their_missing_policy(tmp_path):
    """Saved at 2 ranks, loaded at 3: ranks 0 and 1 get their own values whatever `missing` says; rank 2, which
    had none, keeps the given value ("keep", nothing read) or gets what the function makes of the saved ranks'
    values (a tensor from both ranks' tensors, a plain value from both ranks' positions)."""
    run_ranks(_save_rank_state, 2, str(tmp_path))
    results = run_ranks(_per_rank_entries_with_a_policy_for_new_ranks, 3, str(tmp_path))
    for rank, r in enumerate(results):
        kept, derived = r["True"], r["False"]
        assert kept["common"] == derived["common"] == [7.0]
        if rank < 2:  # their own, read back
            assert kept["rng"] == derived["rng"] == [100.0 + rank] * 5
            assert kept["loader"] == derived["loader"] == {"position": 1000 * rank}
        else:
            assert kept["rng"] == derived["rng"] == [201.0] * 5  # rank 0's + rank 1's
            assert kept["loader"] == {"position": -1} and derived["loader"] == {"position": 1000}


async def _load_with_a_key_the_checkpoint_lacks_on_rank_1(rank: int, world: int, root: str) -> str:
    async with tc.Engine(config(root, collective_timeout=30)) as engine:  # out of step: fails within 30 s
        state = rank_state(rank, False)
        if rank == 1:
            state["extra"] = torch.zeros(10)
        started = time.monotonic()
        with pytest.raises(tc.TieredCkptError) as err:
            await engine.load(state)
        assert time.monotonic() - started < 30
        return str(err.value)


def test_one_rank_failing_to_match_raises_the_same_error_on_every_rank(tmp_path):
    run_ranks(_save_rank_state, 2, str(tmp_path))
    errors = run_ranks(_load_with_a_key_the_checkpoint_lacks_on_rank_1, 2, str(tmp_path))
    assert errors[0].startswith("rank 1 failed: StateError") and "'extra'" in errors[0]  # the others name it
    assert errors[1].startswith("key 'extra' is in the given state")  # the failing rank raises its own error


class Exploding:
    def state_dict(self):
        raise RuntimeError("state_dict exploded")

    def load_state_dict(self, sd):
        pass


async def _state_dict_fails_on_rank_1(rank: int, world: int, root: str, warm: bool) -> dict:
    async with tc.Engine(config(root, commit_timeout=60)) as engine:
        if warm:  # a cached plan: the failing save runs no collective
            await (await engine.save(1, {"w": torch.ones(1000), "m": {"x": 1}})).wait()
        state = {"w": torch.ones(1000), "m": Exploding() if rank == 1 else {"x": 1}}
        started = time.monotonic()
        try:
            await (await engine.save(2, state)).wait()
            error = None
        except tc.TieredCkptError as e:
            error = f"{type(e).__name__}: {e}"
        return {"error": error, "seconds": time.monotonic() - started}


@pytest.mark.parametrize("warm", [False, True], ids=["first-save", "cached-plan"])
def test_a_failing_state_dict_on_one_rank_fails_the_save_on_every_rank(tmp_path, warm):
    results = run_ranks(_state_dict_fails_on_rank_1, 2, str(tmp_path), warm)
    for rank, r in enumerate(results):
        # the failing rank's save() raises; the others' save() (first save: at the plan gather) or wait()
        # (cached plan: their commit wait sees the recorded failure) raise, naming rank 1 and its exception
        assert r["error"] is not None and "RankFailed" in r["error"], r
        assert "rank 1" in r["error"] and "state_dict exploded" in r["error"], r
        assert r["seconds"] < 30


async def _save_a_plain_tensor_that_differs(rank: int, world: int, root: str) -> list[str]:
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("tiered_ckpt.save.plan").addHandler(handler)
    async with tc.Engine(config(root)) as engine:
        state = {"rng": torch.full((8,), float(rank)), "same": torch.ones(100), "own": tc.PerRank(torch.ones(3) * rank)}
        await (await engine.save(1, state)).wait()
    return [r.getMessage() for r in records]


def test_a_tensor_taken_to_be_replicated_that_differs_between_ranks_is_reported(tmp_path):
    messages = run_ranks(_save_a_plain_tensor_that_differs, 2, str(tmp_path))
    assert len(messages[0]) == 1 and "['rng']" in messages[0][0] and "tc.PerRank" in messages[0][0]
    assert messages[1] == []  # rank 0 reports it once
