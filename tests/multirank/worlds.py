"""Tiny DDP and FSDP2 training states for the multi-rank tests that vary the world: build one, train a step,
and take its full values (every rank's shards gathered) to compare a load with the save, bit for bit."""
from __future__ import annotations

import torch

import tiered_ckpt as tc

from .common import config


def build(kind: str, world: int, layers: int = 4, width: int = 16):
    """`layers` Linear(width, width) layers with AdamW: "ddp" (DistributedDataParallel) or "fsdp" (each layer and
    the whole sharded with FSDP2 on a 1-D mesh of `world`). The same initial weights on every rank."""
    torch.manual_seed(0)
    model: torch.nn.Module = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    if kind == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model, optim, width: int = 16) -> None:
    g = torch.Generator().manual_seed(1)
    model(torch.randn(4, width, generator=g)).pow(2).sum().backward()
    optim.step()
    optim.zero_grad()


def full_state(model, optim) -> dict[str, torch.Tensor]:
    """Every model and optimizer tensor, whole (a DTensor's shards gathered: collective with FSDP2)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optim)
    out = {f"model.{k}": v.full_tensor() if type(v).__name__ == "DTensor" else v for k, v in model_sd.items()}
    for fqn, state in optim_sd["state"].items():
        for name, v in state.items():
            out[f"optim.{fqn}.{name}"] = v.full_tensor() if type(v).__name__ == "DTensor" else v
    return out


def mismatches(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """The keys whose values differ (bitwise), or that one side lacks."""
    return sorted(k for k in got.keys() | want.keys()
                  if k not in got or k not in want or not torch.equal(got[k], want[k]))


async def save_trained(kind: str, world: int, root: str) -> dict[str, torch.Tensor]:
    """A model of `kind` after one step, saved as step 1 in `root`/`kind`: its full state, to compare with."""
    model, optim = build(kind, world)
    train_step(model, optim)
    saved = full_state(model, optim)
    async with tc.Engine(config(f"{root}/{kind}")) as engine:
        await (await engine.save(1, {"train": tc.TrainState(model, optim)})).wait()
    return saved


async def load_counted(kind: str, world: int, root: str, saved: dict) -> dict:
    """Load `root`/`kind` into a fresh model (AdamW without state yet): the step, the tensors that differ from
    `saved`, the point-to-point messages the rank sent and received, the bytes it read and the checkpoint's."""
    model, optim = build(kind, world)
    async with tc.Engine(config(f"{root}/{kind}")) as engine:
        c = engine.coordinator
        before = (c.sends, c.receives)
        info = await engine.load({"train": tc.TrainState(model, optim)})
        sends, receives = c.sends - before[0], c.receives - before[1]
        nbytes = (await engine.read_manifest(info.step)).nbytes
    return {"step": info.step, "wrong": mismatches(full_state(model, optim), saved), "sends": sends,
            "receives": receives, "read": sum(info.bytes_by_tier.values()), "nbytes": nbytes}
