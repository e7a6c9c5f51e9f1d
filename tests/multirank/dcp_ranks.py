"""Rank bodies for test_dcp.py (importable by the spawned processes): a small model under FSDP2 (optionally
with tensor parallelism), its Adam state, saved through tiered_ckpt's DCP writer and through DCP's own
FileSystemWriter, and loaded back at other layouts through both readers."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(12, 20)  # 20 rows: uneven shards at 3 ranks
        self.down = torch.nn.Linear(20, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def build(world: int, layout: str, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = Net()
    if layout == "fsdp_tp":  # 2 x 2: FSDP2 over dim 0 of the mesh, tensor parallel over dim 1
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
    else:
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    return model, optimizer


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    torch.manual_seed(1)
    model(torch.randn(4, 12)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def state_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd, "extra": {"epoch": 3}}


def full_values(state: dict[str, Any]) -> dict[str, Any]:
    """Every tensor of the state whole (DTensors gathered), by dotted path; other values as they are."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(state)
    out = {}
    for k, v in flat.items():
        if isinstance(v, torch.Tensor):
            v = v.full_tensor() if type(v).__name__ == "DTensor" else v
            out[k] = v.detach().clone()
        else:
            out[k] = v
    return out


def save(rank: int, world: int, config: Any, fs_dir: str, layout: str, asynchronous: bool) -> dict[str, Any]:
    from tiered_ckpt.dcp import StorageWriter, close

    model, optimizer = build(world, layout, seed=0)
    train_step(model, optimizer)
    state = state_of(model, optimizer)
    writer = StorageWriter(config, step=5)
    if asynchronous:
        dcp.async_save(state, storage_writer=writer).result()
    else:
        dcp.save(state, storage_writer=writer)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(fs_dir))
    expected = full_values(state)
    close()
    return expected


def load(rank: int, world: int, config: Any, fs_dir: str) -> dict[str, Any]:
    """The same model at `world` ranks (FSDP2), fresh weights, loaded once from each checkpoint: both whole."""
    from tiered_ckpt.dcp import StorageReader, close

    got = {}
    for name in ("tiered", "fs"):
        model, optimizer = build(world, "fsdp", seed=7)
        train_step(model, optimizer)  # the optimizer has state to load into
        state = state_of(model, optimizer)
        state["extra"]["epoch"] = 0
        reader = StorageReader(config) if name == "tiered" else dcp.FileSystemReader(fs_dir)
        dcp.load(state, storage_reader=reader)
        got[name] = full_values(state)
    dist.barrier()
    close()
    return got

