"""`verify` beside a live trainer: a checkpoint that retention retires while verify reads it is reported as
retired, not as damage (status 0), so `verify --json || alarm` does not alarm beside every running job; real
damage still counts. The trainer's save that retires the step runs in its own process, at the moment verify
starts reading the step (the read is wrapped, never timed)."""
import asyncio
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import tiered_ckpt as tc
import tiered_ckpt.load.verify as verifying
from tiered_ckpt import cli
from tiered_ckpt.testing.configs import stack_dict, write_toml

TRAINER = textwrap.dedent("""
    import asyncio, sys, torch, tiered_ckpt as tc
    async def main():
        async with tc.Engine.from_toml(sys.argv[1]) as engine:
            await (await engine.save(int(sys.argv[2]), {"w": torch.full((200_000,), 2.0)})).wait()
    asyncio.run(main())
""")


def write_config(tmp_path: Path, shm_dir: Path) -> Path:
    raw = stack_dict(tmp_path, {"kind": "memory", "keep_last": 1}, {"kind": "local", "keep_last": 1}, shm=shm_dir,
                     job="live")
    return write_toml(tmp_path / "tiers.toml", raw)


async def save(config: Path, step: int) -> None:
    async with tc.Engine.from_toml(config) as engine:
        await (await engine.save(step, {"w": torch.ones(200_000)})).wait()


@pytest.mark.timeout(300)
def test_a_step_retired_while_verify_reads_it_is_reported_retired_not_damaged(tmp_path, shm_dir, monkeypatch,
                                                                                capsys):
    config = write_config(tmp_path, shm_dir)
    asyncio.run(save(config, 1))
    real_verify = verifying.verify

    async def a_trainer_retires_it_meanwhile(io, status, manifest, progress=lambda n: None):
        trainer = await asyncio.create_subprocess_exec(sys.executable, "-c", TRAINER, str(config), "2")
        assert await trainer.wait() == 0  # its step 2 retires step 1 everywhere (keep_last = 1)
        return await real_verify(io, status, manifest, progress)

    monkeypatch.setattr(verifying, "verify", a_trainer_retires_it_meanwhile)
    assert cli.main(["-c", str(config), "verify", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    [entry] = report["checkpoints"]
    assert report["ok"] and entry["ok"] and entry["retired"], entry
    assert all(t["retired"] and not t["ok"] for t in entry["tiers"]), entry  # it was read, found gone

    monkeypatch.setattr(verifying, "verify", real_verify)  # damage on a step that stays is still damage
    [part] = [p for p in (tmp_path / "disk").rglob("part-000001")]
    data = bytearray(part.read_bytes())
    data[100] ^= 0xFF
    part.write_bytes(bytes(data))
    assert cli.main(["-c", str(config), "verify", "2"]) == 1
    out = capsys.readouterr().out
    assert "tier disk (complete)" in out and "1 problem(s)" in out and "retired while" not in out
