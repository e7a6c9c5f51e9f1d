"""Pipeline stages as torch.distributed.pipelining holds them: each rank owns a contiguous range of layers,
under their global names (`layers.<i>.…`), with an AdamW of its own (two param groups: weights with decay,
biases without). Saved at PP=1, 2 or 4 and loaded at another: each stage gets exactly its own layers'
parameters, AdamW states and per-group hyper-parameters, bit-exact, and receives no other stage's tensors.
The same beside data parallelism (PP 2 × DP 2 with plain replicas, PP 2 × FSDP2 2), 4 ranks."""
from __future__ import annotations

import pytest
import torch

import tiered_ckpt as tc

from .common import config
from .spawn import run_ranks

pytestmark = pytest.mark.timeout(300)  # real processes (gloo): slower than unit tests
LAYERS, WIDTH = 4, 48


class Stage(torch.nn.Module):
    """Layers [first, last) of a 4-layer MLP, named as in the whole model."""

    def __init__(self, first: int, last: int):
        super().__init__()
        self.layers = torch.nn.ModuleDict({str(i): torch.nn.Linear(WIDTH, WIDTH) for i in range(first, last)})


def stage(rank: int, world: int, trained: bool) -> tuple[Stage, torch.optim.Optimizer]:
    per = LAYERS // world
    torch.manual_seed(0)
    model = Stage(rank * per, (rank + 1) * per)
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    plain = [p for n, p in model.named_parameters() if n.endswith("bias")]
    optim = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1, "lr": 1e-2},
                               {"params": plain, "weight_decay": 0.0, "lr": 3e-3}])
    if trained:
        for i in range(3):  # each layer trained alone, the same whatever stage holds it
            for name, layer in model.layers.items():
                x = torch.full((2, WIDTH), float(int(name) + i))
                layer(x).pow(2).mean().backward()
            optim.step()
            optim.zero_grad()
    return model, optim


def per_layer(model: Stage, optim: torch.optim.Optimizer) -> dict[str, object]:
    """Every parameter, AdamW state and hyper-parameter by the global name of its parameter."""
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, object] = {f"param.{n}": p.detach().clone() for n, p in model.named_parameters()}
    for group in optim.param_groups:
        for p in group["params"]:
            out[f"hyper.{names[id(p)]}"] = (group["lr"], group["weight_decay"], group["betas"], group["eps"])
            for k, v in optim.state[p].items():
                out[f"state.{names[id(p)]}.{k}"] = v.clone()
    return out


async def _save(rank: int, world: int, root: str) -> dict:
    model, optim = stage(rank, world, trained=True)
    async with tc.Engine(config(root, part_size="16KiB")) as engine:
        await (await engine.save(1, {"train": tc.TrainState(model, optim)})).wait()
    return per_layer(model, optim)


async def _load(rank: int, world: int, root: str) -> dict:
    model, optim = stage(rank, world, trained=False)
    async with tc.Engine(config(root, part_size="16KiB")) as engine:
        info = await engine.load({"train": tc.TrainState(model, optim)})
    return {"got": per_layer(model, optim), "received": info.bytes_received,
            "held": sum(p.numel() * 4 * 3 for p in model.parameters())}  # params, exp_avg, exp_avg_sq


def equal(a: object, b: object) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@pytest.mark.parametrize("saved_pp, loaded_pp", [(2, 4), (4, 2), (1, 2), (2, 1)])
def test_stages_split_and_merge(tmp_path, saved_pp, loaded_pp):
    saved: dict[str, object] = {}
    for part in run_ranks(_save, saved_pp, str(tmp_path)):
        saved.update(part)
    for r in run_ranks(_load, loaded_pp, str(tmp_path)):
        got = r["got"]
        assert got and all(equal(v, saved[k]) for k, v in got.items()), [k for k, v in got.items()
                                                                          if not equal(v, saved[k])]
        assert r["received"] <= r["held"], r


async def _load_without_layer_3(rank: int, world: int, root: str) -> str:
    """Two stages that hold layers 0-1 and 2: no rank takes layer 3, which the checkpoint holds."""
    model = Stage(0, 2) if rank == 0 else Stage(2, 3)
    optim = torch.optim.AdamW(model.parameters())
    async with tc.Engine(config(root, part_size="16KiB")) as engine:
        try:
            await engine.load({"train": tc.TrainState(model, optim)})
        except tc.TieredCkptError as e:
            return f"{type(e).__name__}: {e}"
    return "loaded"


def test_an_entry_that_no_stage_takes_is_refused_on_every_rank(tmp_path):
    run_ranks(_save, 2, str(tmp_path))
    errors = run_ranks(_load_without_layer_3, 2, str(tmp_path))
    assert any(e.startswith("StateError") and "layers.3.weight" in e for e in errors), errors
    assert all(e.startswith(("StateError", "RankFailed")) for e in errors), errors


# -- stages beside data parallelism: DP replicas (plain tensors, replicated) and FSDP2 (DTensor shards) ------------

def layout(name: str) -> tuple[int, int, bool]:
    """"pp2dp2" → (pp 2, dp 2, plain replicas); "pp2fsdp2" → (2, 2, FSDP2 over each stage's dp ranks)."""
    pp, _, rest = name[2:].partition("fsdp" if "fsdp" in name else "dp")
    return int(pp), int(rest or 1), "fsdp" in name


def placed_stage(rank: int, world: int, name: str, trained: bool) -> tuple[Stage, torch.optim.Optimizer]:
    """Rank r holds stage r // dp; with FSDP2 its stage is sharded over the dp ranks of that stage."""
    pp, dp, fsdp = layout(name)
    assert pp * dp == world, (name, world)
    per = LAYERS // pp
    torch.manual_seed(0)
    model = Stage(rank // dp * per, (rank // dp + 1) * per)
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))["dp"]
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    plain = [p for n, p in model.named_parameters() if n.endswith("bias")]
    optim = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1, "lr": 1e-2},
                               {"params": plain, "weight_decay": 0.0, "lr": 3e-3}])
    if trained:
        for i in range(3):  # each layer trained alone, the same on every replica
            for lname, layer in model.layers.items():
                layer(torch.full((2, WIDTH), float(int(lname) + i))).pow(2).mean().backward()
            optim.step()
            optim.zero_grad()
    return model, optim


def whole(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return (t.full_tensor() if type(t).__name__ == "DTensor" else t).clone()


def local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if type(t).__name__ == "DTensor" else t
    return t.numel() * t.element_size()


def gathered(model: Stage, optim: torch.optim.Optimizer) -> dict[str, object]:
    """per_layer with FSDP2 shards gathered (a collective over the stage's dp ranks, in the same order on each)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, object] = {f"param.{n}": whole(p) for n, p in model.named_parameters()}
    for group in optim.param_groups:
        for p in group["params"]:
            out[f"hyper.{names[id(p)]}"] = (group["lr"], group["weight_decay"], group["betas"], group["eps"])
            for k, v in optim.state[p].items():
                out[f"state.{names[id(p)]}.{k}"] = whole(v)
    return out


async def _save_placed(rank: int, world: int, root: str, name: str) -> dict:
    model, optim = placed_stage(rank, world, name, trained=True)
    async with tc.Engine(config(root, part_size="16KiB")) as engine:
        await (await engine.save(1, {"train": tc.TrainState(model, optim)})).wait()
    return gathered(model, optim)


async def _load_placed(rank: int, world: int, root: str, name: str) -> dict:
    model, optim = placed_stage(rank, world, name, trained=False)
    async with tc.Engine(config(root, part_size="16KiB")) as engine:
        info = await engine.load({"train": tc.TrainState(model, optim)})
    params = list(model.parameters())
    return {"got": gathered(model, optim), "received": info.bytes_received, "read": sum(info.bytes_by_tier.values()),
            "held": sum(local_bytes(p) * 3 for p in params),  # params, exp_avg, exp_avg_sq
            "steps": len(params) * 8}  # AdamW's 0-d `step` per parameter, replicated: may come from another rank


@pytest.mark.parametrize("saved, loaded", [("pp2dp2", "pp4"), ("pp4", "pp2dp2"), ("pp2fsdp2", "pp4"),
                                           ("pp2fsdp2", "pp1fsdp4")])
def test_stages_beside_dp_and_fsdp2_split_and_merge(tmp_path, saved, loaded):
    reference: dict[str, object] = {}
    for part in run_ranks(_save_placed, 4, str(tmp_path), saved):
        reference.update(part)  # DP replicas return the same values
    results = run_ranks(_load_placed, 4, str(tmp_path), loaded)
    for r in results:
        got = r["got"]
        assert got and all(equal(v, reference[k]) for k, v in got.items()), [k for k, v in got.items()
                                                                              if not equal(v, reference[k])]
        assert r["received"] <= r["held"] + r["steps"], r  # only its own stage's share, never another's
    saved_bytes = sum(v.numel() * v.element_size() for v in reference.values() if isinstance(v, torch.Tensor))
    assert sum(r["read"] for r in results) <= 1.1 * saved_bytes, (saved_bytes, [r["read"] for r in results])
