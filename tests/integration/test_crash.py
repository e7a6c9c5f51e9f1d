"""SIGKILL a saving process at random points: the previous checkpoint stays loadable and the partial
one is never visible as complete (and if it did complete, it loads intact)."""
import asyncio
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import tiered_ckpt as tc

HERE = Path(__file__).parent


def write_config(tmp_path: Path, shm_dir: Path) -> Path:
    path = tmp_path / "crash.toml"
    path.write_text(f"""
[engine]
job = "crash"
index = "file://{tmp_path}/index"
part_size = "1MiB"

[[tiers]]
name = "host"
kind = "memory"
path = "{shm_dir}/host"

[[tiers]]
name = "disk"
kind = "local"
path = "{tmp_path}/disk"
workers = 2
""")
    return path


@pytest.mark.parametrize("seed", range(6))
async def test_sigkill_during_persistence(tmp_path, shm_dir, seed):
    config = write_config(tmp_path, shm_dir)
    proc = subprocess.Popen([sys.executable, str(HERE / "crash_saver.py"), str(config)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "committed 1"
        if seed == 0:
            proc.send_signal(signal.SIGKILL)  # during staging of step 2
        else:
            assert proc.stdout.readline().strip() == "staged 2"
            time.sleep(random.Random(seed).uniform(0.0, 0.25))
            proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()

    async with tc.Engine.from_toml(config) as engine:
        listing = {c.step: c for c in [c async for c in engine.list()]}
        assert listing[1].complete == {"host", "disk"}
        out = {"w": torch.zeros(6 * 2**20), "v": torch.zeros(1000, dtype=torch.float64)}
        info = await engine.load(out, step=1, tiers=["disk"])
        assert torch.all(out["w"] == 1.0) and torch.all(out["v"] == 1.0)
        for tier in listing.get(2, tc.CheckpointStatus(2, ())).complete:  # whatever completed must be whole
            out2 = {"w": torch.zeros(6 * 2**20), "v": torch.zeros(1000, dtype=torch.float64)}
            info = await engine.load(out2, step=2, tiers=[tier])
            assert info.fallbacks == [] and torch.all(out2["w"] == 2.0)
        newest = await engine.load(out)
        assert newest.step == (2 if 2 in listing and listing[2].is_complete else 1)
        # a new save of step 2 clears the leftovers and succeeds
        if 2 not in listing or not listing[2].is_complete:
            await (await engine.save(2, {"w": torch.full((6 * 2**20,), 3.0),
                                         "v": torch.zeros(1000, dtype=torch.float64)})).wait()
            info = await engine.load(out, tiers=["disk"])
            assert info.step == 2 and torch.all(out["w"] == 3.0)
