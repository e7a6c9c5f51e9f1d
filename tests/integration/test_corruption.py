"""Corrupt or truncated parts on the memory tier: load falls back to disk per part and reports it."""
import os
from pathlib import Path

import pytest
import torch

import tiered_ckpt as tc
from tiered_ckpt.layout import PartKey


def part_file(engine, tier, index):
    return Path(engine.tiers[tier].root) / PartKey("test", 1, 0, index).path


async def saved(engine):
    state = {"w": torch.arange(100_000, dtype=torch.float32), "v": torch.randn(3000)}
    await (await engine.save(1, state)).wait()
    return state


async def test_flipped_byte_falls_back_to_disk(engine):
    state = await saved(engine)
    path = part_file(engine, "host", 2)
    data = bytearray(path.read_bytes())
    data[1234] ^= 0x01
    path.write_bytes(bytes(data))
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    info = await engine.load(out)
    assert all(torch.equal(out[k], state[k]) for k in state)
    assert [(f.part, f.tier) for f in info.fallbacks] == [(PartKey("test", 1, 0, 2).path, "host")]
    assert "crc32c" in info.fallbacks[0].reason
    assert info.bytes_by_tier["disk"] == 64 * 1024 and info.tier == "host"


async def test_truncated_and_missing_parts_fall_back(engine):
    state = await saved(engine)
    with open(part_file(engine, "host", 0), "r+b") as f:
        f.truncate(1000)
    os.unlink(part_file(engine, "host", 1))
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    info = await engine.load(out)
    assert all(torch.equal(out[k], state[k]) for k in state)
    reasons = {f.part.rsplit("-", 1)[1]: f.reason for f in info.fallbacks}
    assert "length 1000" in reasons["000000"] and "TierNotFound" in reasons["000001"]


async def test_corrupt_everywhere_is_an_integrity_error_naming_the_part(engine):
    state = await saved(engine)
    for tier in ("host", "disk"):
        path = part_file(engine, tier, 0)
        data = bytearray(path.read_bytes())
        data[0] ^= 0xFF
        path.write_bytes(bytes(data))
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    with pytest.raises(tc.IntegrityError, match=r"part-000000.*host.*disk"):
        await engine.load(out)


async def test_corrupt_index_manifest_falls_back_to_a_tier_copy(engine, tmp_path):
    state = await saved(engine)
    manifest = next((tmp_path / "index").rglob("manifest"))
    manifest.write_bytes(b"\xc1garbage")
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    await engine.load(out)
    assert all(torch.equal(out[k], state[k]) for k in state)


async def test_no_unverified_byte_reaches_the_given_state_and_the_error_names_what_changed(engine):
    """Part 0 holds all of `a` and is corrupt on every tier; part 1 (all of `b`) is intact."""
    state = {"a": torch.ones(16384), "b": torch.full((1000,), 2.0)}  # a: exactly one 64 KiB part
    await (await engine.save(1, state)).wait()
    for tier in ("host", "disk"):
        path = part_file(engine, tier, 0)
        data = bytearray(path.read_bytes())
        data[100] ^= 0x40
        path.write_bytes(bytes(data))
    out = {"a": torch.zeros(16384), "b": torch.zeros(1000)}
    with pytest.raises(tc.IntegrityError, match=r"part-000000.*already overwritten.*\['b'\]") as err:
        await engine.load(out)
    assert "'a'" not in str(err.value).split("already overwritten")[1]
    assert torch.count_nonzero(out["a"]) == 0  # not one corrupt byte in the caller's tensor


async def test_a_module_missing_an_entry_is_refused_before_anything_is_written(engine):
    with_bias = torch.nn.Linear(4, 3)
    await (await engine.save(1, {"model": with_bias, "train": tc.TrainState(with_bias)})).wait()
    without = torch.nn.Linear(4, 3, bias=False)
    before = without.weight.detach().clone()
    with pytest.raises(tc.StateError, match=r"'model'.*lacks.*\['bias'\]"):
        await engine.load({"model": without})
    with pytest.raises(tc.StateError, match=r"'train/model'.*lacks.*\['bias'\]"):
        await engine.load({"train": tc.TrainState(without)})
    assert torch.equal(without.weight, before)
