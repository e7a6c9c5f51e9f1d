"""`tiered-ckpt bench --reshard`: multi-rank loads that change the layout, tiered_ckpt beside DCP in one run.

A stack of MLP blocks with AdamW (`tc.TrainState`; DCP through get_state_dict/set_state_dict), sharded with
FSDP2 (`fsdp`) or FSDP2 x tensor parallel (`fsdp_tp`: a (world/2, 2) mesh, the blocks' up projections
column-wise and down projections row-wise). Each scenario saves at one layout (both libraries, to the same
disk) and loads at another, each library in its own fresh processes (the first load in a process pays
DTensor's one-off warm-up, ~0.15 s here: timed in one process, whichever loaded second looked that much
faster): seconds (the slowest rank), bytes read from storage (all ranks; tiered_ckpt: LoadInfo, DCP: the
kernel's read count) and bytes each rank received from others, and whether the two loads agree bit for bit.
"""
from __future__ import annotations

import asyncio
import datetime
import os
import pickle
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

SCENARIOS = (("fsdp", 2, "fsdp", 4), ("fsdp_tp", 4, "fsdp", 4))  # FSDP2 2 -> 4; FSDP2 x TP 2x2 -> FSDP2 4


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def build(layout: str, world: int, width: int, blocks: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model sharded as `layout` says over `world` ranks (collective: every rank calls it), and AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(Block(width) for _ in range(blocks)))
    if layout == "fsdp_tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        dp = mesh["dp"]
        for block in model:
            parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    else:
        dp = init_device_mesh("cpu", (world,))
    for block in model:
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(model: torch.nn.Module, optim: torch.optim.Optimizer, width: int) -> None:
    model(torch.ones(2, width)).pow(2).mean().backward()
    optim.step()
    optim.zero_grad()


def held_bytes(model: torch.nn.Module, optim: torch.optim.Optimizer) -> int:
    """What this rank's tensors hold: its shards of the parameters and the optimizer states, and the 0-d steps."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optim)
    values = [*model_sd.values(), *(v for state in optim_sd["state"].values() for v in state.values())]
    local = [v.to_local() if type(v).__name__ == "DTensor" else v for v in values if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in local)


def digest(model: torch.nn.Module, optim: torch.optim.Optimizer) -> list[bytes]:
    """Every local shard's bytes, in a fixed order: two loads that agree give equal digests."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optim)
    flat = sorted({**{f"m.{k}": v for k, v in model_sd.items()},
                   **{f"o.{k}.{n}": v for k, s in optim_sd["state"].items() for n, v in s.items()}}.items())
    return [(v.to_local() if type(v).__name__ == "DTensor" else v).reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
            for _, v in flat]


def _config(work: Path) -> Any:
    from ..config import parse_config

    return parse_config({"engine": {"job": "reshard", "index": f"file://{work}/index", "part_size": "4MiB"},
                         "tiers": [{"name": "disk", "kind": "local", "path": str(work / "tiered")}]})


def _read_chars() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def _rank(rank: int, world: int, work: str, action: str, layout: str, width: int, blocks: int) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from ..engine import Engine
    from ..train_state import TrainState

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{work}/store-{action}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    model, optim = build(layout, world, width, blocks)
    out: dict[str, Any] = {}

    async def tiered() -> None:
        async with Engine(_config(Path(work))) as engine:
            if action == "save":
                await (await engine.save(1, {"train": TrainState(model, optim)})).wait()
                return
            dist.barrier()
            started = time.perf_counter()
            info = await engine.load({"train": TrainState(model, optim)})
            out["tiered"] = (time.perf_counter() - started, sum(info.bytes_by_tier.values()), info.bytes_received)

    if action == "save":
        train_step(model, optim, width)
        asyncio.run(tiered())
        model_sd, optim_sd = get_state_dict(model, optim)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{work}/dcp")
    elif action == "load-tiered":
        asyncio.run(tiered())
    else:
        dist.barrier()
        before, started = _read_chars(), time.perf_counter()
        model_sd, optim_sd = get_state_dict(model, optim)
        sd = {"model": model_sd, "optim": optim_sd}
        dcp.load(sd, checkpoint_id=f"{work}/dcp")
        set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        out["dcp"] = (time.perf_counter() - started, _read_chars() - before, None)
        out["held"] = held_bytes(model, optim)
    if action != "save":
        out["digest"] = digest(model, optim)
    Path(work, f"{action}{rank}.pkl").write_bytes(pickle.dumps(out))
    dist.destroy_process_group()


def _spawn(world: int, *args: Any) -> list[dict[str, Any]]:
    from .dist_bench import spawn_ranks

    spawn_ranks(_rank, world, *args)
    return [pickle.loads(Path(args[0], f"{args[1]}{r}.pkl").read_bytes()) for r in range(world)]


def run_reshard_bench(width: int, blocks: int, base: Path, repeats: int = 4) -> str:
    """Every scenario: one save, then `repeats` loads by each library in fresh processes, taking turns at going
    first (4 ranks on a small machine are noisy: one pair of loads says little); a markdown table with every
    load's seconds and the ratio of the medians."""
    rows = ["| save → load | checkpoint | tiered_ckpt load s | DCP load s | ratio of medians | read (tiered / DCP) | "
            "received per rank (max) / held | bit-equal |", "|---|---|---|---|---|---|---|---|"]
    for saved_layout, saved_world, layout, world in SCENARIOS:
        work = Path(tempfile.mkdtemp(prefix="reshard-", dir=base)).resolve()
        try:
            _spawn(saved_world, str(work), "save", saved_layout, width, blocks)
            nbytes = sum(f.stat().st_size for f in (work / "tiered").rglob("part-*"))
            ours, theirs, same = [], [], True
            for r in range(repeats):
                runs = {}
                for action in (("load-tiered", "load-dcp") if r % 2 == 0 else ("load-dcp", "load-tiered")):
                    (work / f"store-{action}").unlink(missing_ok=True)
                    runs[action] = _spawn(world, str(work), action, layout, width, blocks)
                loaded = [{**a, **b} for a, b in zip(runs["load-tiered"], runs["load-dcp"])]
                same = same and all(a["digest"] == b["digest"] for a, b in zip(runs["load-tiered"], runs["load-dcp"]))
                ours.append(max(r["tiered"][0] for r in loaded))
                theirs.append(max(r["dcp"][0] for r in loaded))
            received = max(r["tiered"][2] for r in loaded)
            rows.append(f"| {saved_layout} {saved_world} → {layout} {world} | {nbytes / 2**20:.1f} MiB | "
                        f"{', '.join(f'{t:.3f}' for t in ours)} | {', '.join(f'{t:.3f}' for t in theirs)} | "
                        f"{statistics.median(ours) / statistics.median(theirs):.2f} | "
                        f"{sum(r['tiered'][1] for r in loaded) / nbytes:.2f}x / "
                        f"{sum(r['dcp'][1] for r in loaded) / nbytes:.2f}x | {received / 2**10:.1f} KiB / "
                        f"{max(r['held'] for r in loaded) / 2**10:.0f} KiB | {same} |")
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return "\n".join(rows)


if __name__ == "__main__":  # python -m tiered_ckpt.bench.reshard [width] [blocks] [repeats]
    import argparse

    ap = argparse.ArgumentParser(prog="python -m tiered_ckpt.bench.reshard", description=run_reshard_bench.__doc__)
    ap.add_argument("width", type=int, nargs="?", default=256)
    ap.add_argument("blocks", type=int, nargs="?", default=8)
    ap.add_argument("repeats", type=int, nargs="?", default=4)
    args = ap.parse_args()
    print(run_reshard_bench(args.width, args.blocks, Path(tempfile.gettempdir()), args.repeats))
    os._exit(0)
