"""Several users and jobs on one machine: the memory tier's default folder is the user's own (made 0700), a
tier's capacity counts only this job's bytes, and another live run's checkpoints on a shared tier are never
offered for adoption. Real engines, real files."""
import asyncio
import logging
import os
import pwd
import shutil
import stat
from pathlib import Path

import pytest
import torch

import tiered_ckpt as tc
from tiered_ckpt.testing import configs
from tiered_ckpt.storage.tiers.memory import MemoryOptions

REPO = Path(__file__).resolve().parents[2]


def stack(tmp_path: Path, shm_dir: Path, index: str = "index", job: str = "test", **host) -> tc.Config:
    return configs.stack(tmp_path, {"kind": "memory", **host}, "local", shm=shm_dir, job=job,
                         index=f"file://{tmp_path}/{index}")


def state(value: float) -> dict:
    return {"w": torch.full((50_000,), value)}  # 195 KiB


@pytest.mark.parametrize("user", [None, "someone-else"])
def test_the_memory_tiers_default_folder_is_the_users_own_without_USER(monkeypatch, user):
    if user is None:
        monkeypatch.delenv("USER", raising=False)
    else:
        monkeypatch.setenv("USER", user)  # $USER does not decide it: the uid does
    name = pwd.getpwuid(os.getuid()).pw_name
    assert MemoryOptions().path == f"/dev/shm/tiered_ckpt-{name}"


@pytest.mark.parametrize("preset", sorted(p.name for p in (REPO / "tiers").glob("*.toml")))
def test_presets_put_the_memory_tier_in_the_users_own_folder(preset, monkeypatch):
    monkeypatch.delenv("USER", raising=False)
    monkeypatch.setenv("TIERED_CKPT_JOB", "gpt")
    [host] = [t for t in tc.load_config(REPO / "tiers" / preset).tiers if t.kind == "memory"]
    assert host.options.path == MemoryOptions().path != "/dev/shm/tiered_ckpt"


@pytest.mark.parametrize("stage_in_memory_tier", [True, False])
async def test_the_memory_tier_makes_its_folder_private(tmp_path, shm_dir, stage_in_memory_tier):
    config = stack(tmp_path, shm_dir, keep_last=2)
    config = config.replace_engine(stage_in_memory_tier=stage_in_memory_tier)
    async with tc.Engine(config) as engine:
        await (await engine.save(1, state(1.0))).wait()
    assert stat.S_IMODE((shm_dir / "host").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "disk").stat().st_mode) == 0o700  # the disk's too, whatever the umask


async def test_capacity_counts_only_this_jobs_bytes(tmp_path, shm_dir):
    """Another job's (or user's) files in the same folder do not fill this job's capacity; this job's own
    leftovers still do."""
    other = shm_dir / "host" / "other-job" / "step-000000000001" / "part"
    other.parent.mkdir(parents=True)
    other.write_bytes(b"x" * 900_000)
    staging = shm_dir / "host" / ".staging" / "test-abc-18c0d3f2a1b2c3d4e-r0-host-p1" / "buf-0"  # job test-abc
    staging.parent.mkdir(parents=True)
    staging.write_bytes(b"x" * 900_000)
    async with tc.Engine(stack(tmp_path, shm_dir, capacity="1MiB", keep_last=1)) as engine:
        await (await engine.save(1, state(1.0))).wait()
        assert (await engine.status(1)).complete == {"host", "disk"}
    mine = shm_dir / "host" / "test" / "leftover"
    mine.write_bytes(b"x" * 900_000)
    async with tc.Engine(stack(tmp_path, shm_dir, capacity="1MiB", keep_last=1)) as engine:
        handle = await engine.save(2, state(2.0))
        await handle.wait()  # complete on disk
        assert set(handle.errors) == {"host"} and isinstance(handle.errors["host"], tc.TierFull)


async def test_another_live_runs_checkpoints_are_not_offered_for_adoption(tmp_path, shm_dir, caplog):
    """A run with its own index finds a run's checkpoints on the tiers they share: that run's index still exists,
    so they are a stranger's, and no `adopt = true` is suggested; once that index is gone, it is."""
    async with tc.Engine(stack(tmp_path, shm_dir, index="theirs")) as engine:
        await (await engine.save(1, state(1.0))).wait()
    async with tc.Engine(stack(tmp_path, shm_dir, index="mine")) as engine:
        with caplog.at_level(logging.WARNING), pytest.raises(tc.IncompleteCheckpoint):
            await engine.load(state(0.0))
        assert f"of another run, committed to its index file://{tmp_path}/theirs, which still exists" in caplog.text
        assert "adopt" not in caplog.text
        caplog.clear()
        await asyncio.to_thread(shutil.rmtree, tmp_path / "theirs")  # the index moved or was lost
        with caplog.at_level(logging.WARNING), pytest.raises(tc.IncompleteCheckpoint):
            await engine.load(state(0.0))
        assert "set adopt = true in [engine] to load them" in caplog.text
