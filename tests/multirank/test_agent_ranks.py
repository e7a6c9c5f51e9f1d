"""Two real ranks (gloo) with [engine] agent = "on" share one node agent; both trainers are SIGKILLed right after
their save of step 2 committed on the memory tier, while the agent's disk writes are held: the disk tier still
commits, for both ranks (its commit needs every rank's durable marker, which the agent writes for each), and
after the memory is wiped the step loads from disk, bit-exact."""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

import tiered_ckpt as tc
from tiered_ckpt.testing.configs import faults

from .common import config
from .spawn import run_ranks

pytestmark = pytest.mark.timeout(120)


def rank_state(rank: int, world: int, fill: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.arange(2**19 * world, dtype=torch.float32).reshape(world * 512, 1024)
    mesh = init_device_mesh("cpu", (world,))
    return {"w": distribute_tensor(full if fill else torch.zeros_like(full), mesh, [Shard(0)])}


async def _save_then_die(rank: int, world: int, root: str) -> None:
    import torch.distributed as dist

    cfg = config(root, disk="faulty", agent="on", part_size="1MiB")
    async with tc.Engine(cfg) as engine:
        await (await engine.save(1, rank_state(rank, world, False))).wait()
        if rank == 0:
            faults(cfg).inject("stall", ops=["write"])  # the agent's disk copies of step 2 wait until cleared
        dist.barrier()
        handle = await engine.save(2, rank_state(rank, world, True))
        await handle.wait("host")  # committed on the memory tier, and handed to the agent
        dist.barrier()
        os.kill(os.getpid(), signal.SIGKILL)


async def test_two_ranks_killed_after_their_memory_commit_get_their_disk_copy(tmp_path):
    folder = tmp_path / "agent"
    env = {"TIERED_CKPT_AGENT_DIR": str(folder), "TIERED_CKPT_AGENT_IDLE": "1"}
    exitcodes: dict[int, int | None] = {}
    run_ranks(_save_then_die, 2, str(tmp_path), may_die=frozenset({0, 1}), env=lambda r: env,
              exitcodes=exitcodes, timeout=90)
    assert exitcodes == {0: -signal.SIGKILL, 1: -signal.SIGKILL}
    cfg = config(str(tmp_path), disk="faulty", agent="off", distributed=False)
    control = faults(cfg)
    async with tc.Engine(cfg) as engine:
        listing = {c.step: c for c in [c async for c in engine.list()]}
        assert listing[2].complete == {"host"}  # the trainers are gone, the disk copies held
        assert control.stalled() >= 1  # the agent is writing them
        control.clear()
        deadline = time.monotonic() + 20
        while "disk" not in listing[2].complete:
            assert time.monotonic() < deadline, listing[2]
            await asyncio.sleep(0.1)
            listing = {c.step: c for c in [c async for c in engine.list()]}
    shutil.rmtree(tmp_path / "shm")  # the node rebooted: the memory tier is gone
    out = {"w": torch.zeros(1024, 1024)}
    async with tc.Engine(cfg) as engine:
        info = await engine.load(out)
    assert info.step == 2 and info.tier == "disk"
    assert torch.equal(out["w"], torch.arange(2**20, dtype=torch.float32).reshape(1024, 1024))
    pid = int((folder / "agent.lock").read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]:
        assert time.monotonic() < deadline, "the agent did not exit when idle"
        time.sleep(0.1)
