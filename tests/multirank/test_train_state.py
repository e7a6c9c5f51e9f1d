"""Model and AdamW state of an FSDP2-sharded model: saved at 4 ranks, loaded bit-exactly at 2 and 3."""
from __future__ import annotations

import pytest
import torch

import tiered_ckpt as tc

from .common import config
from .spawn import run_ranks

pytestmark = pytest.mark.timeout(300)  # real processes (gloo, torchrun): slower than unit tests


def build(world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.ReLU(), torch.nn.Linear(13, 5))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def full_state(model, optim) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optim)
    out = {f"model.{k}": v.full_tensor() for k, v in model_sd.items()}
    for fqn, state in optim_sd["state"].items():
        for name, v in state.items():
            out[f"optim.{fqn}.{name}"] = v.full_tensor() if type(v).__name__ == "DTensor" else v
    return out


async def _save(rank: int, world: int, root: str) -> dict:
    model, optim = build(world)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        model(torch.randn(4, 7, generator=g)).pow(2).sum().backward()
        optim.step()
        optim.zero_grad()
    async with tc.Engine(config(root)) as engine:
        await (await engine.save(3, {"train": tc.TrainState(model, optim), "epoch": 1})).wait()
    return full_state(model, optim)


async def _load(rank: int, world: int, root: str) -> dict:
    model, optim = build(world)  # fresh: AdamW has no state yet
    state = {"train": tc.TrainState(model, optim), "epoch": 0}
    async with tc.Engine(config(root)) as engine:
        info = await engine.load(state)
    return {"step": info.step, "epoch": state["epoch"], "state": full_state(model, optim)}


def test_fsdp_model_and_adamw_reshard_4_to_2_to_3(tmp_path):
    saved = run_ranks(_save, 4, str(tmp_path))[0]
    assert any(k.endswith("exp_avg_sq") for k in saved)
    for world in (2, 3):
        for result in run_ranks(_load, world, str(tmp_path)):
            assert result["step"] == 3 and result["epoch"] == 1
            got = result["state"]
            assert got.keys() == saved.keys()
            for k in saved:
                assert torch.equal(got[k], saved[k]), (world, k)
