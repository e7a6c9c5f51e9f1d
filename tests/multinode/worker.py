"""One rank of a multi-node test job: Cluster.run_job (nodes.py) starts it inside a node, with torchrun's
environment (RANK, WORLD_SIZE, GROUP_RANK, MASTER_ADDR, ...) and

    SPEC    JSON: {"config": TOML path, "action": "save" | "load" | "train" | "load_save" | "run",
                   "steps": [int, ...] (save, load_save: saved one after the other, each waited for),
                   "tiers": [tier names] (load, optional), "first": int and "progress": path (train: save
                   first, first+1, ... until killed, each waited for and committed on every tier, the last
                   such step written to progress + ".<rank>"); run: save each of "steps" as a training loop does (no wait on
                   the handle, "interval" seconds apart, the step written to progress + ".<rank>"), then wait for
                   them all, and report each step's tiers committed and failed, and what save() raised;
                   "fresh_ok" (load_save): an IncompleteCheckpoint (nothing to resume) starts fresh and saves;
                   "agent_dir" (any action): the node agent's folder is agent_dir/<hostname> (one agent per node),
                   idle "agent_idle" seconds; "faults": {hostname: TIERED_CKPT_FAULT} for the ranks of that node
                   (tiered_ckpt/lifecycle/fault_points.py; the agent a rank starts inherits it); "also_tiers"
                   (load): after the load, one more load per list of tiers, each reported under "also" by its
                   tiers joined;
                   "hard_exit": the rank exits without tearing down the process group (a peer may be dead)}
    RESULT  where to write this rank's JSON result

A load also reports what its background heal rewrote (`healed`: parts per tier, after engine.wait_healed())
and every saved rank's size (`rank_nbytes`), so a test can tell which tier served which rank's parts.

The state is deterministic from the step, so a load can check every value: a replicated model (the same
on every rank) and one tensor sharded over all ranks (a DTensor, Shard(0)), so each rank has parts of its
own. With part_size 16KiB each rank writes several parts. A load that raises is recorded in the result
(`error`), and the rank exits 0, so the test can assert on the error.
"""
from __future__ import annotations

import asyncio
import datetime
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import tiered_ckpt as tc

MODEL = 40_000        # "weight": 160 KB, "bias": 40 KB, replicated
ROWS, COLS = 192, 256  # the sharded tensor, 192 KiB whatever the world (1, 2, 3, 4 or 6 ranks): 64 KiB a rank at 3


def write_progress(prefix: str, step: int) -> None:
    """Replace the rank's progress file whole (a test polls it; an in-place write can be read empty)."""
    path = Path(f"{prefix}.{dist.get_rank()}")
    partial = path.with_name(path.name + ".partial")
    partial.write_text(str(step))
    os.replace(partial, path)


def state(step: int | None, mesh: DeviceMesh) -> dict[str, Any]:
    """What save(step) holds; step=None: zeros of the same shapes (the target of a load)."""
    full = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    model = {"weight": torch.arange(MODEL, dtype=torch.float32), "bias": torch.ones(MODEL // 4)}
    if step is None:
        full, model = torch.zeros_like(full), {k: torch.zeros_like(v) for k, v in model.items()}
    else:
        full, model = full + 1000 * step, {k: v * (step + 1) for k, v in model.items()}
    return {"model": model, "sharded": {"table": distribute_tensor(full, mesh, [Shard(0)])}, "step": step}


def matches(loaded: dict[str, Any], expected: dict[str, Any]) -> bool:
    """Every tensor equal to the save's (the DTensor assembled whole: a collective, so every rank calls it)."""
    same = [torch.equal(loaded["model"][k], v) for k, v in expected["model"].items()]
    same.append(torch.equal(loaded["sharded"]["table"].full_tensor(), expected["sharded"]["table"].full_tensor()))
    return all(same) and loaded["step"] == expected["step"]


def node_env(spec: dict[str, Any]) -> None:
    """This node's agent folder and fault points, from the spec (before the engine opens: read once)."""
    host = socket.gethostname()
    # one agent folder per node (where a config turns the agent on): the nodes share this tree, not their memory
    agent_dir = spec.get("agent_dir") or str(Path(spec["config"]).parent / "agents")
    os.environ["TIERED_CKPT_AGENT_DIR"] = f"{agent_dir}/{host}"
    os.environ["TIERED_CKPT_AGENT_IDLE"] = str(spec.get("agent_idle", 5))  # (2 s: an open on a loaded machine took longer)
    fault = spec.get("faults", {}).get(host)
    if fault:
        os.environ["TIERED_CKPT_FAULT"] = fault


async def main(spec: dict[str, Any], mesh: DeviceMesh) -> dict[str, Any]:
    result: dict[str, Any] = {"action": spec["action"], "hostname": socket.gethostname()}
    node_env(spec)
    async with tc.Engine.from_toml(spec["config"]) as engine:
        if spec["action"] == "save":
            errors = {}
            for step in spec["steps"]:
                handle = await engine.save(step, state(step, mesh))
                await handle.wait()
                if handle.errors:  # reported: a test that expects every tier written says which one was not
                    errors[str(step)] = {tier: str(e) for tier, e in handle.errors.items()}
            result["steps"], result["save_errors"] = spec["steps"], errors
            return result
        if spec["action"] == "train":
            step = spec["first"]
            try:
                while True:
                    handle = await engine.save(step, state(step, mesh))
                    await handle.wait()
                    if handle.errors:  # progress counts a step committed on every tier (one on node-local
                        raise tc.SaveError(step, handle.errors)  # tiers alone can be lost with the node)
                    write_progress(spec["progress"], step)
                    step += 1
            except Exception as e:  # a node died: the save in flight fails; say when
                return {**result, "error": f"{type(e).__name__}: {e}", "ended": time.time()}
        if spec["action"] == "run":
            return {**result, **await run(engine, spec, mesh)}
        target = state(None, mesh)
        try:
            info = await engine.load(target, tiers=spec.get("tiers"))
        except tc.IncompleteCheckpoint as e:
            if not spec.get("fresh_ok") or isinstance(e, tc.CheckpointLost):
                return {**result, "error": f"{type(e).__name__}: {e}", "exact": False}
            for step in spec.get("steps", []):  # nothing to resume: training starts fresh, and saves
                await (await engine.save(step, state(step, mesh))).wait()
            return {**result, "fresh": f"{type(e).__name__}: {e}", "saved": spec.get("steps", []), "error": None}
        except Exception as e:  # recorded: the test asserts on it
            return {**result, "error": f"{type(e).__name__}: {e}", "exact": False}
        healed: dict[str, int] = {}
        for report in await engine.wait_healed():
            for tier, parts in report.parts.items():
                healed[tier] = healed.get(tier, 0) + parts
        manifest = await engine.read_manifest(info.step)
        exact = matches(target, state(info.step, mesh))
        also = {}
        for tiers in spec.get("also_tiers", []):
            again = state(None, mesh)
            try:
                more = await engine.load(again, tiers=tiers)
            except Exception as e:
                also[",".join(tiers)] = {"error": f"{type(e).__name__}: {e}", "exact": False}
                continue
            also[",".join(tiers)] = {"error": None, "step": more.step, "exact": matches(again, state(more.step, mesh)),
                                     "bytes_by_tier": dict(more.bytes_by_tier),
                                     "fallbacks": [f.tier for f in more.fallbacks]}
        result["also"] = also
        result["listing"] = {str(c.step): sorted(c.complete) async for c in engine.list()}
        saved = []
        for step in spec.get("steps", []):  # load_save: training goes on after the resume
            await (await engine.save(step, state(step, mesh))).wait()
            saved.append(step)
    return {**result, "step": info.step, "tier": info.tier, "bytes_by_tier": dict(info.bytes_by_tier),
            "fallbacks": [f.tier for f in info.fallbacks], "bytes_received": info.bytes_received,
            "exact": exact, "error": None, "healed": healed, "saved": saved,
            "rank_nbytes": [r.nbytes for r in manifest.ranks]}


async def run(engine: tc.Engine, spec: dict[str, Any], mesh: DeviceMesh) -> dict[str, Any]:
    """Save like a training loop: save() and go on; a raise from save() is what stops training."""
    handles, raised, blocked = [], None, []
    for step in spec["steps"]:
        tensors = state(step, mesh)  # built before the clock starts: the first DTensor imports torch._dynamo
        started = time.monotonic()  # (2 s of CPU on a quiet machine, 18 s seen under CI's load)
        try:
            handles.append(await engine.save(step, tensors))
        except Exception as e:
            raised = f"{type(e).__name__}: {e}"
            break
        blocked.append(time.monotonic() - started)
        write_progress(spec["progress"], step)
        await asyncio.sleep(spec.get("interval", 0.2))
    await engine.wait_all()
    outcomes = {h.step: {"committed": list(h.committed_on), "failed": sorted(h.errors)} for h in handles}
    skipped = {h.step: sorted(h.skipped) for h in handles if h.skipped}  # tiers a newer save superseded it on
    return {"outcomes": outcomes, "skipped": skipped, "raised": raised, "blocked": max(blocked, default=0.0),
            "blocked_by_step": [round(b, 3) for b in blocked], "error": raised}


if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))  # env://: torchrun's variables
    result = asyncio.run(main(json.loads(os.environ["SPEC"]), init_device_mesh("cpu", (dist.get_world_size(),))))
    out = Path(os.environ["RESULT"])
    out.with_suffix(".tmp").write_text(json.dumps(result))
    out.with_suffix(".tmp").replace(out)
    if result.get("error") and result["action"] == "train":
        os._exit(3)  # a peer is dead: tearing down the process group would wait for it
    if json.loads(os.environ["SPEC"]).get("hard_exit"):
        os._exit(0)
    if not result.get("error"):  # no rank tears its links down while another still uses them (seen once:
        dist.barrier()  # gloo's SIGABRT, "terminate called without an active exception", after a load's result)
    dist.destroy_process_group()
