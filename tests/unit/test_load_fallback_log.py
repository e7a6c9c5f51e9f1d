"""What a load says of its fallbacks (#31): each part that fell back is warned about once per process however
many loads read it (a resume loads a state in pieces), and a memory tier that holds nothing of the step after
a restart is one info line, not a warning per part. Real engines (memory + disk tiers), real files, caplog."""
import logging
import shutil

import torch

import tiered_ckpt as tc

LOADER = "tiered_ckpt.load.loader"


def pieces(value: float):
    return {"model": {"w": torch.full((20_000,), value)}, "opt": {"m": torch.full((20_000,), -value)}}


async def save_one(config) -> None:
    async with tc.Engine(config) as engine:
        await (await engine.save(1, pieces(1.0))).wait()


async def load_in_pieces(config) -> None:
    """A resume that loads the model, then the optimizer: the part holding both is read twice."""
    async with tc.Engine(config) as engine:
        for key in ("model", "opt"):
            out = {key: pieces(0.0)[key]}
            info = await engine.load(out)
            (name, got), = out[key].items()
            assert info.fallbacks and torch.equal(got, pieces(1.0)[key][name])


def records(caplog, level):
    return [r.getMessage() for r in caplog.records if r.name == LOADER and r.levelno == level]


async def test_a_memory_tier_emptied_by_a_restart_is_one_info_line(make_config, shm_dir, caplog):
    config = make_config(heal=False)
    await save_one(config)
    shutil.rmtree(shm_dir / "host")  # a reboot: /dev/shm is empty, the disk holds the checkpoint
    (shm_dir / "host").mkdir()
    caplog.set_level(logging.INFO, logger=LOADER)
    await load_in_pieces(config)
    assert records(caplog, logging.WARNING) == []
    assert records(caplog, logging.INFO) == [
        "step 1: tier host holds none of it on this node (emptied since the save, e.g. by a restart); read from "
        "the next tier"]


async def test_a_damaged_part_is_warned_about_once_however_often_it_is_read(make_config, shm_dir, caplog):
    config = make_config(heal=False)  # the damaged copy stays: the second load meets it again
    await save_one(config)
    parts = sorted(p for p in (shm_dir / "host").rglob("part-*") if p.is_file())
    assert len(parts) == 3  # 160 KB in 64 KiB parts: the second holds the end of model/w and the start of opt/m
    damaged = bytearray(parts[1].read_bytes())
    damaged[100] ^= 0xFF
    parts[1].write_bytes(bytes(damaged))
    caplog.set_level(logging.INFO, logger=LOADER)
    await load_in_pieces(config)
    warnings = records(caplog, logging.WARNING)
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("step 1: 1 part read(s) fell back to a slower tier: ") and warnings[0].count(
        " on host: ") == 1 and parts[1].name in warnings[0], warnings
    assert records(caplog, logging.INFO) == []
