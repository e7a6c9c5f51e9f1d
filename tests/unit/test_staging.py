"""Staging buffers: backpressure (max_inflight), reuse, the memory tier's own files as the buffer, detaching
while a slow tier streams, checksums of staged parts, leftovers of dead processes."""
import asyncio
import contextlib
import os

import pytest
import torch

import tiered_ckpt as tc
from tiered_ckpt.layout import PartKey, parse_key, step_dir

from .common import load_values, state_of, wait_until


async def test_max_inflight_makes_the_next_save_wait_never_drop(make_config):
    # one buffer, a slow disk: save 2 must wait until save 1's parts are on the memory tier, then proceed
    # (with skip_when_behind = false every save reaches every tier, however far behind the disk is)
    async with tc.Engine(make_config(max_inflight=1, tiers=[{}, {"skip_when_behind": False}])) as engine:
        handles = []
        for step in range(1, 6):
            handles.append(await engine.save(step, state_of(float(step))))
        for h in handles:
            await h.wait()
        steps = [c.step for c in [c async for c in engine.list()] if c.complete == {"host", "disk"}]
        assert steps == [1, 2, 3, 4, 5]
        for step in range(1, 6):
            for tier in ("host", "disk"):
                _, out = await load_values(engine, step=step, tiers=[tier])
                assert torch.all(out["w"] == step), (step, tier)


async def test_detached_save_reads_back_from_the_faster_tier(make_config, monkeypatch):
    """A slow disk does not hold the staging buffer hostage: once save 1's parts are on the memory tier,
    save 2 takes the buffer (after the one disk write in progress) and disk reads the rest from memory.
    The disk is held by gates, not slowed by sleeps: its first write holds the buffer until save 2 has been
    started, and its other writes wait (before borrowing any bytes) until save 2 has the buffer."""
    async with tc.Engine(make_config(max_inflight=1, tiers=[{}, {"workers": 1}], stage_in_memory_tier=False)) as engine:
        io, host = engine.store.io, engine.store.io.driver("host")
        write_from, read_into = io.write_from, host.read_into
        first_holds, first_go, rest_go = asyncio.Event(), asyncio.Event(), asyncio.Event()
        disk_writes, read_back = [], []

        async def gated_write_from(tier, key, nbytes, source, what):
            if tier != "disk":
                return await write_from(tier, key, nbytes, source, what)
            disk_writes.append(key)
            if len(disk_writes) > 1:
                await rest_go.wait()
                return await write_from(tier, key, nbytes, source, what)

            @contextlib.asynccontextmanager
            async def held():
                async with source() as data:  # the staging buffer's bytes, borrowed while the write lasts
                    first_holds.set()
                    await first_go.wait()
                    yield data
            return await write_from(tier, key, nbytes, held, what)

        async def counting_read_into(key, out):
            read_back.append(key)
            return await read_into(key, out)

        monkeypatch.setattr(io, "write_from", gated_write_from)
        monkeypatch.setattr(host, "read_into", counting_read_into)
        h1 = await engine.save(1, state_of(1.0))  # 4 parts of 64 KiB
        await asyncio.wait_for(first_holds.wait(), 30)
        saving = asyncio.create_task(engine.save(2, state_of(2.0)))
        first_go.set()
        h2 = await asyncio.wait_for(saving, 30)
        assert not h1.done()  # save 2 got the buffer while save 1's disk writes still wait
        assert not read_back
        rest_go.set()
        await h1.wait()
        await h2.wait()
        assert read_back and all("step-000000000001" in k for k in read_back)
        for step in (1, 2):
            _, out = await load_values(engine, step=step, tiers=["disk"])
            assert torch.all(out["w"] == step)


async def test_staging_buffers_are_reused_not_grown(make_config):
    async with tc.Engine(make_config(stage_in_memory_tier=False)) as engine:
        seen = set()
        for step in range(1, 6):
            await engine.save(step, state_of(float(step)))
            await engine.wait_all()
            seen.update(id(b) for b in engine.pool.free)
            assert engine.pool.buffers == 1
        assert len(seen) == 1


async def test_the_staging_buffer_is_the_memory_tier_copy_and_retired_checkpoints_become_the_next_buffer(
        make_config, monkeypatch):
    """With a memory tier first (keep_last = 2, max_inflight = 1): save() copies into the memory tier's own
    part files (no part is written there through the driver), and once retention retires a checkpoint its
    files (same inodes: pages already allocated) stage a later save. Three buffers in all, for ten saves."""
    async with tc.Engine(make_config(tiers=[{"keep_last": 2}])) as engine:
        host = engine.store.io.driver("host")
        writes = []
        real_write = host.write

        async def counting_write(key, data):
            writes.append(key)
            return await real_write(key, data)

        monkeypatch.setattr(host, "write", counting_write)
        buffers, inodes = set(), {}
        for step in range(1, 11):
            await (await engine.save(step, state_of(float(step)))).wait()
            held = engine.pool.retained[step]
            buffers.add(id(held))
            keys = [k for k in await host.list(f"test/{step_dir(step)}/") if parse_key(k).kind == "part"]
            assert [host.path_of(k) for k in sorted(keys)] == held.files.paths
            inodes[step] = {os.stat(p).st_ino for p in held.files.paths}
        # only records, manifests (and the writer's probe value at its start) went through write
        assert all(".probe-" in k or parse_key(k).kind != "part" for k in writes)
        assert len(buffers) == 3 and inodes[10] == inodes[7]  # step 7's files, retired at step 9, hold step 10
        assert [c.step for c in await engine.statuses() if "host" in c.complete] == [9, 10]
        for step in (9, 10):
            _, out = await load_values(engine, step=step, tiers=["host"])
            assert torch.all(out["w"] == step)
    async with tc.Engine(make_config(tiers=[{"keep_last": 2}])) as engine:  # a restarted process
        _, out = await load_values(engine, tiers=["host"])
        assert torch.all(out["w"] == 10.0)


async def test_a_memory_tier_too_small_for_its_staging_buffers_is_refused(make_config):
    async with tc.Engine(make_config(tiers=[{"keep_last": 2, "capacity": "700KiB"}])) as engine:
        with pytest.raises(tc.ConfigError, match=r"tiers.host.capacity.*keep_last \+ 1 \+ max_inflight = 2 \+ 1 \+ 1"):
            await engine.save(1, state_of(1.0))  # 4 x ~200 KB
        assert [c async for c in engine.list()] == []


async def test_max_inflight_backpressure_holds_the_next_save_until_a_buffer_frees(make_config, monkeypatch):
    """With max_inflight = 1 and both tiers held, save 2 cannot take the only staging buffer: save() waits
    (it neither drops the save nor allocates a second buffer) until a tier holds save 1's parts."""
    async with tc.Engine(make_config(max_inflight=1, role="writer")) as engine:  # the tiers' probe done at open
        release = asyncio.Event()
        for name in ("host", "disk"):
            tier = engine.store.io.driver(name)
            real_write = tier.write

            async def held_write(key, data, real_write=real_write):
                await release.wait()
                return await real_write(key, data)

            monkeypatch.setattr(tier, "write", held_write)
        h1 = await engine.save(1, state_of(1.0))
        second = asyncio.create_task(engine.save(2, state_of(2.0)))
        await wait_until(lambda: engine.pool.waiting == 1, what="save 2 waiting for a staging buffer")
        # save 1 holds the only buffer a save may hold; the next one may be made ahead, never taken
        assert not second.done() and engine.pool.held == 1 and engine.pool.buffers <= 2
        release.set()
        h2 = await second
        await h1.wait()
        await h2.wait()
        for step in (1, 2):
            _, out = await load_values(engine, step=step)
            assert torch.all(out["w"] == step)


@pytest.mark.parametrize("while_staging", [False, True])
async def test_part_checksums_are_the_same_whether_hashed_during_or_after_the_copy(make_config, monkeypatch,
                                                                                    while_staging):
    """Parts are hashed as soon as they are staged on machines with spare cores, after the copy elsewhere:
    the recorded checksums are those of the staged bytes either way (many chunks, several parts): each chunk's
    digest, and for the part the digest of its chunk digests."""
    import tiered_ckpt.save.job as saving
    import tiered_ckpt.save.records as records
    from tiered_ckpt.checksum import chunk_digest, of_chunk_digests, part_checksum

    monkeypatch.setattr(saving, "HASH_WHILE_STAGING", while_staging)
    monkeypatch.setattr(records, "CHUNK_SIZE", 1 << 14)  # 4 chunks a part
    state = {f"t{i}": torch.randn(3000 + 17 * i) for i in range(40)}  # ~500 KB: 8 parts of 64 KiB
    async with tc.Engine(make_config()) as engine:
        await (await engine.save(1, state)).wait()
        manifest = await engine.read_manifest(1)
        host = engine.store.io.driver("host")
        parts = [memoryview(await host.read(PartKey("test", 1, 0, p, engine.incarnation).path))
                 for p in range(len(manifest.ranks[0].checksums))]
        size = manifest.chunk_size
        assert 0 < size < len(parts[0]) and len(parts) >= 8
        expected = [part_checksum([part], manifest.checksum, size) for part in parts]
        assert list(manifest.ranks[0].checksums) == expected
        sums = [b"".join(chunk_digest(part[a:a + size], manifest.checksum).to_bytes(8, "little")
                         for a in range(0, len(part), size)) for part in parts]
        assert [manifest.chunk_sums_of(0, p) for p in range(len(parts))] == sums
        assert expected == [of_chunk_digests(s, manifest.checksum) for s in sums]
        out = {k: torch.zeros_like(v) for k, v in state.items()}
        await engine.load(out, tiers=["disk"])
        assert all(torch.equal(out[k], v) for k, v in state.items())


async def test_staging_buffers_of_a_dead_process_are_removed_at_the_next_open(make_config, shm_dir):
    """A process killed mid-save leaves its staging files in the memory tier's .staging folder (RAM). A live
    process holds a flock on its folder's .owner file; the next engine of the job removes, at its first save,
    the folders nobody holds (whatever their PIDs say: PIDs are reused), and keeps a live one's."""
    import fcntl

    staging = shm_dir / "host" / ".staging"
    gone, alive = staging / "test-0123456789abcdef-r0-somehost-p2", staging / "test-fedcba9876543210-r0-somehost-p2"
    for folder in (gone, alive):
        (folder / "buf-0").mkdir(parents=True)
        (folder / "buf-0" / "part-000000").write_bytes(b"x" * 4096)
        (folder / ".owner").touch()
    holder = os.open(alive / ".owner", os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX)  # as its (live) process does
    try:
        async with tc.Engine(make_config()) as engine:
            assert gone.exists()  # opening changes nothing on the tier
            await (await engine.save(1, state_of(1.0))).wait()
            assert not gone.exists() and alive.exists()
            assert any(staging.glob("test-*-p*/.owner")) and len(list(staging.iterdir())) == 2
        assert len(list(staging.iterdir())) == 1  # close() removed this engine's own folder
    finally:
        os.close(holder)


async def test_a_full_tmpfs_stages_in_anonymous_memory_and_the_save_goes_on(make_config, monkeypatch):
    """Preallocating the memory tier's staging files fails (tmpfs full): save() does not raise; it stages in
    anonymous memory and both tiers still get the checkpoint."""
    import errno

    import tiered_ckpt.save.mapped as mapped

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(mapped.os, "posix_fallocate", full)
    async with tc.Engine(make_config()) as engine:
        handle = await engine.save(1, state_of(1.0))
        await handle.wait()
        assert engine.pool.arena is not None and not engine.pool.retained  # the fallback buffer is anonymous
        for tier in ("host", "disk"):
            _, out = await load_values(engine, tiers=[tier])
            assert torch.all(out["w"] == 1.0)


async def test_slower_tiers_start_once_the_staging_memory_tier_is_marked_durable(make_config, monkeypatch):
    """When the staging buffer is the memory tier's files, the disk writes start only after this rank marked
    the memory tier durable: a file index's fsyncs would otherwise queue behind the disk's writeback. (The
    trainer's own drain: with the node agent, the disk is written only once the memory tier committed.)"""
    async with tc.Engine(make_config(role="writer", agent="off")) as engine:  # the tiers' probe writes done at open
        order = []
        real_mark, real_write = engine.store.index.mark_durable, engine.store.io.driver("disk").write

        async def mark(job, step, tier, *args):
            order.append(f"mark {tier}")
            return await real_mark(job, step, tier, *args)

        async def write(key, data):
            order.append("disk write")
            return await real_write(key, data)

        monkeypatch.setattr(engine.store.index, "mark_durable", mark)
        monkeypatch.setattr(engine.store.io.driver("disk"), "write", write)
        await (await engine.save(1, state_of(1.0))).wait()
        assert order.index("mark host") < order.index("disk write"), order


async def test_the_next_saves_buffer_is_made_ahead_while_the_memory_tier_fills_up(make_config):
    """keep_last = 2, max_inflight = 1: saves 1-3 each need a buffer of their own before retention hands the
    first one back. Each next one is made in the background once the previous save is staged, so saves 2 and
    3 take a ready buffer instead of allocating one while the caller waits; then step 1's files come back and
    save 4 takes them: three buffers in all."""
    async with tc.Engine(make_config(tiers=[{"keep_last": 2}])) as engine:
        await (await engine.save(1, state_of(1.0))).wait()
        first, made = engine.pool.retained[1], []
        for step in (2, 3):
            await wait_until(lambda: len(engine.pool.free) == 1, what=f"a buffer made ahead for save {step}")
            made.append(engine.pool.free[0])
            await (await engine.save(step, state_of(float(step)))).wait()
            assert engine.pool.retained[step] is made[-1]
        assert engine.pool.free == (first,)  # step 1 retired: its files are the next buffer; nothing else made
        await (await engine.save(4, state_of(4.0))).wait()
        assert engine.pool.retained[4] is first and engine.pool.free == (made[0],)  # step 2 retired: the next
        for step in (3, 4):
            _, out = await load_values(engine, step=step, tiers=["host"])
            assert torch.all(out["w"] == step)
