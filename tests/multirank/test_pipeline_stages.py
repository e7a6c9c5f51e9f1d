"""Pipeline stages as torch.distributed.pipelining holds them: each rank owns a contiguous range of layers,
under their global names (`layers.<i>.…`), with an AdamW of its own (two param groups: weights with decay,
biases without). Saved at PP=1, 2 or 4 and loaded at another: each stage gets exactly its own layers'
parameters, AdamW states and per-group hyper-parameters, bit-exact, and receives no other stage's tensors."""
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
