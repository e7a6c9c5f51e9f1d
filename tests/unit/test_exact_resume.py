"""docs/state.md, *Resume that is exact*: a DataLoader with a generator of its own (seeded per epoch), the position
saved as (epoch, batch) and the global RNG saved with `tc.PerRank` resume a run with dropout bit for bit; a
DataLoader without its own generator does not, even with the order and the RNG restored, because creating its
iterator draws from the global RNG (its base seed), which shifts every dropout mask after a resume."""
from __future__ import annotations

import itertools

import torch
from torch.utils.data import DataLoader, TensorDataset

import tiered_ckpt as tc

EPOCHS, SAVE_AT = 2, 13  # 10 batches per epoch: the checkpoint is 3 batches into the second epoch


def train(ckpt: tc.Checkpointer, *, own_generator: bool, stop_at: int | None = None) -> dict[str, torch.Tensor]:
    """The loop of docs/state.md (own_generator) or the same loop with a plain sequential DataLoader."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.5), torch.nn.Linear(32, 1))
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(40, 8, generator=g), torch.randn(40, 1, generator=g))
    loader = DataLoader(data, batch_size=4, shuffle=own_generator, generator=g if own_generator else None)
    progress = {"epoch": 0, "batch": 0, "step": 0}
    state = {"model": model, "optim": optim, "progress": progress, "rng": tc.PerRank(torch.get_rng_state())}
    try:
        ckpt.load(state)
        torch.set_rng_state(state["rng"].value)
    except tc.IncompleteCheckpoint:
        pass
    while progress["epoch"] < EPOCHS:
        g.manual_seed(100 + progress["epoch"])  # the epoch's order (and base seed), whatever came before
        for x, y in itertools.islice(loader, progress["batch"], None):  # skips the batches already trained
            torch.nn.functional.mse_loss(model(x), y).backward()
            optim.step()
            optim.zero_grad()
            progress["batch"] += 1
            progress["step"] += 1
            if progress["step"] == stop_at:
                state["rng"] = tc.PerRank(torch.get_rng_state())
                ckpt.save(progress["step"], state).wait()
                return {}
        progress["epoch"] += 1
        progress["batch"] = 0
    return {k: v.clone() for k, v in model.state_dict().items()}


def resumed_and_straight(make_config, own_generator: bool) -> tuple[dict, dict]:
    with tc.Checkpointer(make_config(job=f"own-{own_generator}")) as ckpt:
        train(ckpt, own_generator=own_generator, stop_at=SAVE_AT)
        resumed = train(ckpt, own_generator=own_generator)
    with tc.Checkpointer(make_config(job=f"straight-{own_generator}")) as ckpt:
        straight = train(ckpt, own_generator=own_generator)
    return resumed, straight


def test_own_generator_saved_position_and_per_rank_rng_resume_bit_for_bit(make_config):
    resumed, straight = resumed_and_straight(make_config, own_generator=True)
    assert resumed.keys() == straight.keys()
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)


def test_a_dataloader_without_its_own_generator_shifts_the_dropout_masks(make_config):
    resumed, straight = resumed_and_straight(make_config, own_generator=False)
    assert not torch.equal(resumed["0.weight"], straight["0.weight"])
