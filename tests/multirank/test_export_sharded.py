"""A checkpoint saved by 2 ranks that each hold shards (DTensor Shard(0) and Shard(1), uneven, a tensor spanning
several parts, an FSDP2 model with AdamW, keys held by one rank) exports from one process without a process
group as full tensors, equal to the originals, in each format."""
from __future__ import annotations

import asyncio

import pytest
import torch

import tiered_ckpt as tc

from .common import config
from .spawn import run_ranks
from .test_train_state import build as build_fsdp

pytestmark = pytest.mark.timeout(300)  # real processes (gloo): slower than unit tests


def full(name: str) -> torch.Tensor:
    shapes = {"w": (7, 5), "v": (6, 9), "big": (300, 100), "b": (11,)}
    n = 1
    for s in shapes[name]:
        n *= s
    return (torch.arange(n, dtype=torch.float64) + 1000.0 * len(name)).reshape(shapes[name])


def flat_tensors(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for k, v in (tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()):
        if isinstance(v, torch.Tensor):
            out[f"{prefix}{k}"] = v
        else:
            out.update(flat_tensors(v, f"{prefix}{k}."))
    return out


async def _save(rank: int, world: int, root: str) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    model, optim = build_fsdp(world)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        model(torch.randn(4, 7, generator=g)).pow(2).sum().backward()
        optim.step()
        optim.zero_grad()
    state = {"train": tc.TrainState(model, optim),
             "layers": {"w": distribute_tensor(full("w"), mesh, [Shard(0)]),   # 4 + 3 rows
                        "v": distribute_tensor(full("v"), mesh, [Shard(1)]),   # column boxes: not contiguous
                        "big": distribute_tensor(full("big"), mesh, [Shard(0)]),  # 117 KiB a rank: 2+ parts
                        "b": distribute_tensor(full("b"), mesh, [Shard(0)])},
             f"only{rank}": torch.full((3,), float(rank)),  # a key one rank holds
             "progress": {"step": 9, "lr": 0.5}}
    async with tc.Engine(config(root)) as engine:
        await (await engine.save(9, state)).wait()
    model_sd, optim_sd = get_state_dict(model, optim)
    whole = {k: v.full_tensor() for k, v in model_sd.items()}
    moments = {f"{fqn}.{name}": v.full_tensor() if type(v).__name__ == "DTensor" else v
               for fqn, s in optim_sd["state"].items() for name, v in s.items()}
    return {"model": whole, "moments": moments}


def test_a_sharded_checkpoint_exports_whole_tensors(tmp_path):
    import safetensors.torch
    import torch.distributed.checkpoint as dcp

    root = str(tmp_path / "ckpt")
    saved = run_ranks(_save, 2, root)[0]
    out = tmp_path / "out"

    async def export() -> dict:
        async with tc.Engine(config(root)) as engine:  # no process group: one process
            infos = {to: await engine.export(out / to, to=to) for to in ("safetensors", "torch", "dcp")}
            infos["model"] = await engine.export(out / "model.safetensors", to="safetensors", select="train.model")
            manifest = await engine.read_manifest(9)
        assert manifest.world_size == 2 and any(len(t.chunks) == 2 for t in manifest.tensors)
        return infos

    infos = asyncio.run(export())
    assert all(i.step == 9 for i in infos.values())
    expected = {f"layers.{k}": full(k) for k in ("w", "v", "big", "b")}
    expected |= {"only0": torch.zeros(3), "only1": torch.ones(3)}
    expected |= {f"train.model.{k}": v for k, v in saved["model"].items()}
    expected |= {f"train.optim.state.{k}": v for k, v in saved["moments"].items()}

    st = safetensors.torch.load_file(out / "safetensors")
    assert sorted(st) == sorted(expected)
    for name, t in expected.items():
        assert torch.equal(st[name], t) and st[name].dtype == t.dtype, name

    pt = torch.load(out / "torch", weights_only=True)
    assert pt["progress"] == {"step": 9, "lr": 0.5}
    got = flat_tensors(pt)
    assert sorted(got) == sorted(expected)
    assert all(torch.equal(got[name], t) for name, t in expected.items())

    template = {"layers": {k: torch.zeros_like(full(k)) for k in ("w", "v", "big", "b")},
                "only0": torch.empty(3), "only1": torch.empty(3), "progress": {"step": 0, "lr": 0.0}}
    dcp.load(template, checkpoint_id=str(out / "dcp"))
    assert template["progress"] == {"step": 9, "lr": 0.5}
    assert all(torch.equal(template["layers"][k], full(k)) for k in ("w", "v", "big", "b"))
    assert torch.equal(template["only1"], torch.ones(3))

    plain = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.ReLU(), torch.nn.Linear(13, 5))  # no FSDP
    plain.load_state_dict(safetensors.torch.load_file(out / "model.safetensors"))
    assert all(torch.equal(v, saved["model"][k]) for k, v in plain.state_dict().items())
