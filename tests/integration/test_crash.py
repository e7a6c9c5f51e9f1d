"""SIGKILL a saving process inside each phase of a save (staging, some parts on one tier, one tier committed,
manifest written, index commit): the previous checkpoint stays loadable, the partial one is never visible
as complete where it is not whole, and what did complete loads intact."""
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tiered_ckpt as tc
from tiered_ckpt.testing.configs import stack_dict, write_toml

HERE = Path(__file__).parent


def write_config(tmp_path: Path, shm_dir: Path) -> Path:
    return write_toml(tmp_path / "crash.toml", stack_dict(tmp_path, "memory", {"kind": "local", "workers": 2},
                                                         shm=shm_dir, job="crash", part_size="1MiB"))


# phase → the tiers on which step 2 is complete after the kill
PHASES = {"staging": set(), "parts-partly-on-host": set(), "host-committed": {"host"}, "manifest-written": set(),
          "index-commit": set()}


@pytest.mark.parametrize("phase", PHASES)
async def test_sigkill_in_each_phase_of_a_save(tmp_path, shm_dir, phase):
    config = write_config(tmp_path, shm_dir)
    proc = subprocess.Popen([sys.executable, str(HERE / "crash_saver.py"), str(config), phase],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "committed 1"
        assert proc.stdout.readline().strip() == f"phase {phase}"  # the save stopped in that phase
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()

    async with tc.Engine.from_toml(config) as engine:
        listing = {c.step: c for c in [c async for c in engine.list()]}
        assert listing[1].complete == {"host", "disk"}
        assert (listing[2].complete if 2 in listing else set()) == PHASES[phase]
        out = {"w": torch.zeros(6 * 2**20), "v": torch.zeros(1000, dtype=torch.float64)}
        await engine.load(out, step=1, tiers=["disk"])
        assert torch.all(out["w"] == 1.0) and torch.all(out["v"] == 1.0)
        for tier in PHASES[phase]:  # whatever completed must be whole
            info = await engine.load(out, step=2, tiers=[tier])
            assert info.fallbacks == [] and torch.all(out["w"] == 2.0)
        newest = await engine.load(out)
        assert newest.step == (2 if PHASES[phase] else 1)
        if not PHASES[phase]:  # a new save of step 2 clears the leftovers and succeeds
            await (await engine.save(2, {"w": torch.full((6 * 2**20,), 3.0),
                                         "v": torch.zeros(1000, dtype=torch.float64)})).wait()
            info = await engine.load(out, tiers=["disk"])
            assert info.step == 2 and torch.all(out["w"] == 3.0)
