"""Coordinator.on_first, the one helper for "rank 0 decides, every rank gets the answer or raises the same
error", on two real gloo ranks: the function runs on rank 0 alone; its result reaches every rank; an error
that is the decision itself (no checkpoint to load) is raised as the same class and message everywhere; any
other error is rank 0's own there and a RankFailed naming rank 0 and what it was doing on the others."""
from tiered_ckpt.distributed.coordinator import Coordinator
from tiered_ckpt.errors import IncompleteCheckpoint

from .spawn import run_ranks


async def _decide(rank: int, world_size: int) -> tuple[object, int, list[str]]:
    coordinator = await Coordinator.create(60)
    calls = []

    async def value() -> dict[str, int]:
        calls.append(rank)
        return {"step": 7}

    async def no_checkpoint() -> None:
        raise IncompleteCheckpoint("job 'j' has no complete checkpoint")

    async def bug() -> None:
        raise KeyError("boom")

    got = await coordinator.on_first(value, "choosing")
    outcomes = []
    for fn in (no_checkpoint, bug):
        try:
            await coordinator.on_first(fn, "picking the checkpoint to load", answers=(IncompleteCheckpoint,))
        except Exception as e:
            outcomes.append(f"{type(e).__name__}: {e}")
    await coordinator.destroy()
    return got, len(calls), outcomes


def test_rank_0_decides_and_every_rank_gets_its_answer_or_the_same_error():
    first, second = run_ranks(_decide, 2, timeout=120)
    assert first == ({"step": 7}, 1, ["IncompleteCheckpoint: job 'j' has no complete checkpoint", "KeyError: 'boom'"])
    assert second == ({"step": 7}, 0, [
        "IncompleteCheckpoint: job 'j' has no complete checkpoint",
        "RankFailed: rank 0 failed while picking the checkpoint to load: KeyError: 'boom'"])
