"""Corrupt or truncated parts on the memory tier: load falls back to disk per part and reports it."""
import os
from pathlib import Path

import pytest
import torch

import tiered_ckpt as tc
from tiered_ckpt.layout import PartKey, manifest_key


def part_file(engine, tier, index):
    return Path(engine.store.io.driver(tier).root) / PartKey("test", 1, 0, index, engine.incarnation).path


async def saved(engine):
    state = {"w": torch.arange(100_000, dtype=torch.float32), "v": torch.randn(3000)}
    await (await engine.save(1, state)).wait()
    return state


@pytest.mark.parametrize("algorithm", ["xxh3", "crc32c"])
async def test_flipped_byte_falls_back_to_disk(make_config, algorithm):
    """Under either part checksum (the manifest names it), a flipped bit is caught and read from disk."""
    async with tc.Engine(make_config(checksum=algorithm)) as engine:
        state = await saved(engine)
        assert (await engine.read_manifest(1)).checksum == algorithm
        path = part_file(engine, "host", 2)
        data = bytearray(path.read_bytes())
        data[1234] ^= 0x01
        path.write_bytes(bytes(data))
        out = {k: torch.zeros_like(v) for k, v in state.items()}
        info = await engine.load(out)
        assert all(torch.equal(out[k], state[k]) for k in state)
        assert [(f.part, f.tier) for f in info.fallbacks] == [
            (PartKey("test", 1, 0, 2, engine.incarnation).path, "host")]
        assert algorithm in info.fallbacks[0].reason
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


async def test_bit_flips_in_metadata_never_load_wrong_data(engine, tmp_path):
    """Single-bit flips anywhere in the index's manifest or rank record: each load either uses another copy
    (a tier's) and returns the saved state exactly, or fails with a TieredCkptError; never wrong data."""
    import random

    state = await saved(engine)
    rng = random.Random(0)
    for record in ("manifest", "ranks/0"):
        path = next(p for p in (tmp_path / "index").rglob("*") if p.as_posix().endswith(f"step-000000000001/{record}"))
        original = path.read_bytes()
        for _ in range(60):
            data = bytearray(original)
            bit = rng.randrange(len(data) * 8)
            data[bit // 8] ^= 1 << (bit % 8)
            path.write_bytes(bytes(data))
            out = {k: torch.zeros_like(v) for k, v in state.items()}
            try:
                await engine.load(out)
            except tc.TieredCkptError:
                continue
            assert all(torch.equal(out[k], state[k]) for k in state), (record, bit)
        path.write_bytes(original)


async def test_no_intact_manifest_anywhere_is_an_error_naming_every_copy(engine, tmp_path):
    state = await saved(engine)
    copies = [next((tmp_path / "index").rglob("manifest"))] + [
        Path(engine.store.io.driver(t).root) / manifest_key("test", 1, engine.incarnation) for t in ("host", "disk")]
    for path in copies:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(data))
    with pytest.raises(tc.CheckpointLost, match=r"index manifest.*corrupt.*tier 'host'.*corrupt.*tier 'disk'"):
        await engine.load({k: torch.zeros_like(v) for k, v in state.items()})


async def test_verify_reports_a_corrupt_manifest_copy(engine):
    from tiered_ckpt.load.verify import verify

    await saved(engine)
    path = Path(engine.store.io.driver("disk").root) / manifest_key("test", 1, engine.incarnation)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    reports = {r.tier: r for r in await verify(engine.store.io, await engine.status(1), await engine.read_manifest(1))}
    assert reports["host"].ok and not reports["disk"].ok
    assert len(reports["disk"].bad) == 1 and "manifest.msgpack" in reports["disk"].bad[0] and "corrupt" in reports["disk"].bad[0]


async def test_verify_holds_a_few_parts_in_memory_not_the_checkpoint(make_config):
    """8 MiB of parts (64 KiB each) on two tiers: verify's peak Python allocation stays a few parts."""
    import tracemalloc

    from tiered_ckpt.load.verify import VERIFY_PARTS, verify

    async with tc.Engine(make_config()) as engine:
        await (await engine.save(1, {"w": torch.randn(2 << 20)})).wait()
        status, manifest = await engine.status(1), await engine.read_manifest(1)
        tracemalloc.start()
        try:
            reports = await verify(engine.store.io, status, manifest)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert all(r.ok for r in reports) and sum(r.parts for r in reports) == 2 * 128
        # a few parts, one chunk buffer per I/O thread (4 per tier), and the small objects of 256 part reads and
        # their reports (~0.25 MiB measured; 1 MiB allowed): the whole checkpoint is 8 MiB on each tier
        assert peak < (VERIFY_PARTS + 2 * 4) * 64 * 1024 + 2**20, peak


@pytest.mark.parametrize("field, value", [("part_size", 0), ("world_size", "2"), ("checksum", "md5"),
                                          ("incarnation", "../../etc"), ("skeleton", 10**12), ("step", -1)])
async def test_a_sealed_manifest_with_impossible_fields_is_an_integrity_error(engine, field, value):
    """A record whose seal is intact (re-sealed by a bug or by hand) but whose fields are impossible fails
    when it is read, naming the record, instead of failing later inside a load (or allocating 1 TB)."""
    import msgpack

    from tiered_ckpt.checksum import seal, unseal
    from tiered_ckpt.manifest import Manifest

    await saved(engine)
    data = await engine.store.index.get_manifest("test", 1)
    body = msgpack.unpackb(unseal(data, "m"), strict_map_key=False)
    body[field] = value
    with pytest.raises(tc.IntegrityError, match="not a valid manifest"):
        Manifest.from_bytes(seal(msgpack.packb(body)), source="the test's manifest")


async def test_a_chunk_is_verified_before_it_is_copied_and_a_corrupt_one_never_reaches_the_state(make_config):
    """Parts of 2 MiB are read a chunk (1 MiB) at a time, each chunk verified against its own digest before it
    is copied on. `a` fills chunk 0 and `b` chunk 1 of the one part. With chunk 1 corrupt on the memory tier,
    the part comes from disk (a fallback naming the chunk); corrupt on both, the load fails, `a` (verified) may
    be written and is named, and not one corrupt byte reaches `b`."""
    state = {"a": torch.full((2**18,), 1.0), "b": torch.full((2**18,), 2.0)}
    async with tc.Engine(make_config(part_size="2MiB")) as engine:
        await (await engine.save(1, state)).wait()
        manifest = await engine.read_manifest(1)
        assert manifest.chunk_size == 2**20 and len(manifest.ranks[0].chunk_sums) == 2 * 8

        def corrupt(tier):
            path = part_file(engine, tier, 0)
            data = bytearray(path.read_bytes())
            data[2**20 + 100] ^= 0x40  # in b, in chunk 1
            path.write_bytes(bytes(data))

        corrupt("host")
        out = {k: torch.zeros_like(v) for k, v in state.items()}
        info = await engine.load(out)
        assert torch.equal(out["a"], state["a"]) and torch.equal(out["b"], state["b"])
        assert [(f.tier, f.reason.split(":")[0]) for f in info.fallbacks] == [("host", "chunk 1")]
        corrupt("disk")
        out = {k: torch.zeros_like(v) for k, v in state.items()}
        with pytest.raises(tc.IntegrityError, match=r"chunk 1.*already overwritten with checkpoint data: \[.a.\];"):
            await engine.load(out)
        assert torch.count_nonzero(out["b"]) == 0


async def test_verify_checks_that_a_parts_checksum_follows_from_its_chunk_digests(make_config, monkeypatch):
    """A part's checksum is the digest of its chunk digests (format 4). A load checks the chunk digests only;
    verify also checks that they add up to the part's checksum, so a record that disagrees with itself (a bug
    at save time) is reported on every tier, though the bytes match their chunk digests and still load."""
    import tiered_ckpt.checksum as checksum
    import tiered_ckpt.save.records as records
    from tiered_ckpt.load.verify import verify

    real = checksum.of_chunk_digests
    wrong = lambda sums, algorithm: real(sums, algorithm) ^ 1  # noqa: E731
    monkeypatch.setattr(checksum, "of_chunk_digests", wrong)  # the save's part checksums, hashed after the copy
    monkeypatch.setattr(records, "of_chunk_digests", wrong)  # ... or while staging
    async with tc.Engine(make_config(agent="off")) as engine:  # (patched here: every tier written in this process)
        state = await saved(engine)
        monkeypatch.setattr(checksum, "of_chunk_digests", real)
        monkeypatch.setattr(records, "of_chunk_digests", real)
        manifest = await engine.read_manifest(1)
        assert manifest.chunk_size and manifest.ranks[0].chunk_sums
        out = {k: torch.zeros_like(v) for k, v in state.items()}
        await engine.load(out)
        assert all(torch.equal(out[k], state[k]) for k in state)
        status = [c async for c in engine.list()][0]
        reports = await verify(engine.store.io, status, manifest)
        assert [r.tier for r in reports] == ["host", "disk"]
        for report in reports:
            assert len(report.bad) == len(manifest.ranks[0].checksums)
            assert all("chunk digests disagree" in bad for bad in report.bad)


async def test_a_damaged_memory_copy_is_repaired_after_the_load(make_config):
    """A part of the memory tier's copy flipped: the load falls back to disk for it, then heals the copy in the
    background, so the next load reads it from memory again."""
    async with tc.Engine(make_config()) as engine:
        state = await saved(engine)
        path = part_file(engine, "host", 2)
        data = bytearray(path.read_bytes())
        data[1234] ^= 0x01
        path.write_bytes(bytes(data))
        out = {k: torch.zeros_like(v) for k, v in state.items()}
        first = await engine.load(out)
        assert [f.tier for f in first.fallbacks] == ["host"]
        reports = await engine.wait_healed()
        assert [r.parts for r in reports] == [{"host": 1}] and not reports[0].errors
        again = await engine.load(out)
        assert not again.fallbacks and again.bytes_by_tier.keys() == {"host"}
        assert all(torch.equal(out[k], state[k]) for k in state)
