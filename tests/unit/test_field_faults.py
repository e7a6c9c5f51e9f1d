"""Faults that operations cause, on the file index and the local tiers: each heals, never hands back the
wrong step, leaks or kills the trainer (docs/operations.md, the fault table)."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import tiered_ckpt as tc
from tiered_ckpt.layout import step_dir

from .common import load_values, state_of


async def test_a_renamed_step_folder_in_the_index_never_serves_one_step_as_another(engine, tmp_path):
    """One flipped bit in a folder name (step-…1 → step-…3): the index lists step 3, whose records are step
    1's. A load must not report step 3 and fill step 1's tensors: the copy is refused and step 1, the only
    checkpoint, still loads as itself."""
    await (await engine.save(1, state_of(1.0))).wait()
    index = tmp_path / "index" / "test"
    os.rename(index / step_dir(1), index / step_dir(3))
    info, out = await load_values(engine)
    assert (info.step, float(out["w"][0])) == (1, 1.0)
    with pytest.raises(tc.IncompleteCheckpoint, match="is the manifest of job 'test' step 1"):
        await load_values(engine, step=3)


async def test_a_crash_between_retentions_unmark_and_the_removal_leaves_nothing_behind(make_config, shm_dir):
    """Retention unmarked step 2 on both tiers (and a removal dropped step 1's record), then the process died
    before it removed their data: whole checkpoints, in /dev/shm that is RAM, which no index record leads to
    any more. The next run's saves converge: keep_last on each tier, whatever the index forgot."""
    async with tc.Engine(make_config(tiers=[{"keep_last": 10}, {}])) as engine:
        for step in (1, 2, 3, 4):
            await (await engine.save(step, state_of(float(step)))).wait()
        for tier in ("host", "disk"):  # what drop_tier does before the data goes: the index first
            await engine.store.index.unmark(engine.job, 2, tier)
        await engine.store.index.delete(engine.job, 1)
    config = make_config(tiers=[{"keep_last": 2}, {"keep_last": 2}])
    held = lambda root: sorted(p.name for p in (root / "test").iterdir() if p.name.startswith("step-"))  # noqa: E731
    async with tc.Engine(config) as engine:
        for step in (5, 6):
            await (await engine.save(step, state_of(float(step)))).wait()
        for root in (shm_dir / "host", Path(config.tiers[1].options.path)):
            assert held(root) == [step_dir(5), step_dir(6)], root


async def test_a_full_disk_retires_the_oldest_to_make_room_and_advances(make_config):
    """A disk with room for fewer than keep_last + 1 states (capacity 48 MiB, 20 MiB states, keep_last 2):
    every save used to fail with TierFull from step 3 on, so the disk stayed at step 2. Now the oldest
    checkpoint is retired to make room (never the newest complete one) and the disk follows training."""
    big = lambda v: {"w": torch.full((5 * 2**20,), v)}  # noqa: E731  (20 MiB)
    async with tc.Engine(make_config(tiers=[{}, {"keep_last": 2, "capacity": "48MiB"}])) as engine:
        for step in range(1, 7):
            await (await engine.save(step, big(float(step)))).wait()
        on_disk = [c.step for c in await engine.statuses() if "disk" in c.complete]
        assert on_disk[-1] == 6 and len(on_disk) <= 2, on_disk
        out = big(0.0)
        assert (await engine.load(out, tiers=["disk"])).step == 6 and torch.all(out["w"] == 6.0)


def test_a_truncated_part_file_in_dev_shm_never_kills_the_trainer(tmp_path, shm_dir):
    """A cleanup script truncates a committed part file of the memory tier. When retention retires that step,
    its files used to become the next staging buffer, and the next save's copy into the mapping of a file
    that is shorter than the mapping killed the process (SIGBUS, exit -7). Now the buffer is dropped."""
    script = textwrap.dedent(f"""
        import asyncio, os, pathlib, torch, tiered_ckpt as tc
        from tiered_ckpt.layout import PartKey
        from tiered_ckpt.testing.configs import stack

        config = stack("{tmp_path}", {{"kind": "memory", "keep_last": 1}}, "local", shm="{shm_dir}", job="t")

        async def main():
            async with tc.Engine(config) as engine:
                await (await engine.save(1, {{"w": torch.ones(100_000)}})).wait()
                part = pathlib.Path("{shm_dir}/host") / PartKey("t", 1, 0, 0, engine.incarnation).path
                os.truncate(part, 0)  # another job's cleanup
                for step in range(2, 6):  # step 1's files come back as a buffer when step 2 retires it
                    await (await engine.save(step, {{"w": torch.full((100_000,), float(step))}})).wait()
                out = {{"w": torch.zeros(100_000)}}
                assert (await engine.load(out)).step == 5 and torch.all(out["w"] == 5.0)
            print("survived")

        asyncio.run(main())
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert proc.returncode == 0 and "survived" in proc.stdout, (proc.returncode, proc.stderr[-3000:])
