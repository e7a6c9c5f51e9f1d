"""The `faulty` tier: `local` with no faults (it passes the conformance suite), and each fault doing what it
says on real files, in this process and in others that share the control file, and through a real engine."""
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import tiered_ckpt as tc
from tiered_ckpt.config import parse_config
from tiered_ckpt.layout import probe_key
from tiered_ckpt.storage.tiers.base import start_tier
from tiered_ckpt.testing import TierConformance
from tiered_ckpt.testing.faults import PROBE, FaultControl, FaultyOptions, FaultyTier
from tiered_ckpt.tier_kinds import driver_class, known_kinds

KEY = "job/step-000000000001/ix-00000000/s1/rank-00000/part-000000"
OTHER = "job/step-000000000001/ix-00000000/s1/manifest.msgpack"
VALUE = bytes(range(256)) * 40  # 10,240 bytes


class TestFaultyTier(TierConformance):
    """With no faults (no control file at all) it is a `local` tier."""

    @pytest.fixture
    def make_tier(self, tmp_path):
        return lambda: FaultyTier("disk", FaultyOptions(path=str(tmp_path / "disk"), control=str(tmp_path / "f.json")))


@pytest.fixture
async def started(tmp_path):
    """started(rank=0) → an opened faulty tier over tmp_path/disk, controlled by tmp_path/faults.json."""
    executor, tiers = ThreadPoolExecutor(4), []

    async def start(rank: int = 0) -> FaultyTier:
        options = FaultyOptions(path=str(tmp_path / "disk"), control=str(tmp_path / "faults.json"))
        tiers.append(await start_tier(FaultyTier("disk", options), executor, rank=rank, world_size=2))
        return tiers[-1]

    yield start
    for tier in tiers:
        await tier.close()
    executor.shutdown(wait=True)


@pytest.fixture
def faults(tmp_path):
    return FaultControl(tmp_path / "faults.json")


async def test_fail_is_retryable_error_is_not_and_clear_ends_both(started, faults):
    tier = await started()
    faults.inject("fail")
    with pytest.raises(tc.TierUnavailable, match="tier 'disk'.*injected") as err:
        await tier.write(KEY, memoryview(VALUE))
    assert err.value.retryable and not (tier.root / KEY).exists()
    faults.clear()
    faults.inject("error", ops=["read", "list"])
    await tier.write(KEY, memoryview(VALUE))  # writes are not named: they work
    for op in (tier.read(KEY), tier.list("job/")):
        with pytest.raises(tc.TierError) as err:
            await op
        assert not err.value.retryable and not isinstance(err.value, tc.TierUnavailable)
    faults.clear()
    assert await tier.read(KEY) == VALUE and await tier.list("job/") == [KEY]


async def test_full_fails_writes_as_a_full_disk_and_leaves_reads_alone(started, faults):
    tier = await started()
    await tier.write(KEY, memoryview(VALUE))
    faults.inject("full")
    with pytest.raises(tc.TierFull) as err:
        await tier.write(OTHER, memoryview(b"m"))
    assert isinstance(err.value, OSError) and not err.value.retryable
    assert await tier.read(KEY) == VALUE and await tier.list("job/") == [KEY]


async def test_corrupt_reads_flip_one_byte_of_the_stored_value_on_every_read_path(started, faults, tmp_path):
    tier = await started()
    await tier.write(KEY, memoryview(VALUE))
    faults.inject("corrupt", ops=["read"])

    def differs(got: bytes) -> list[int]:
        return [i for i in range(len(VALUE)) if got[i] != VALUE[i]]

    assert differs(await tier.read(KEY)) == [len(VALUE) // 2]
    a, b = bytearray(6000), bytearray(len(VALUE) - 6000)
    assert await tier.read_into(KEY, [memoryview(a), memoryview(b)]) == len(VALUE)
    assert differs(bytes(a + b)) == [len(VALUE) // 2]
    chunks = bytearray(len(VALUE))

    def consume(chunk, offset):
        chunks[offset:offset + len(chunk)] = chunk
        return True

    assert await tier.read_chunks(KEY, 4096, len(VALUE), consume) == len(VALUE)
    assert differs(bytes(chunks)) == [len(VALUE) // 2]
    assert (tmp_path / "disk" / KEY).read_bytes() == VALUE  # the stored bytes are intact: only reads lie
    faults.clear()
    assert await tier.read(KEY) == VALUE


async def test_vanish_acknowledges_the_write_then_the_value_is_gone(started, faults):
    tier = await started()
    faults.inject("vanish", keys="part-")
    await tier.write(KEY, memoryview(VALUE))
    await tier.write(OTHER, memoryview(b"manifest"))  # keys: only parts vanish
    with pytest.raises(tc.TierNotFound):
        await tier.read(KEY)
    assert await tier.missing([KEY, OTHER]) == [KEY] and await tier.list("job/") == [OTHER]


async def test_a_stall_waits_on_the_event_loop_without_blocking_it(started, faults):
    tier = await started()
    faults.inject("stall", seconds=0.5)
    ticks, started_at = [], time.monotonic()

    async def ticker():
        while True:
            ticks.append(time.monotonic())
            await asyncio.sleep(0.01)

    beat = asyncio.ensure_future(ticker())
    await tier.write(KEY, memoryview(VALUE))
    beat.cancel()
    assert time.monotonic() - started_at >= 0.5 and await tier.read(KEY) == VALUE
    assert len(ticks) >= 10 and max(b - a for a, b in zip(ticks, ticks[1:])) < 0.25  # the loop kept running


async def test_a_stall_without_seconds_lasts_until_cleared_and_a_timeout_abandons_it(started, faults):
    tier = await started()
    faults.inject("stall", ops=["list"])
    with pytest.raises(asyncio.TimeoutError):  # as the pipeline's timeout abandons it
        await asyncio.wait_for(tier.list("job/"), 0.3)
    assert faults.stalled() == 0  # the abandoned one is no longer stalled
    listing = asyncio.ensure_future(tier.list("job/"))
    await asyncio.sleep(0.2)
    assert not listing.done() and faults.stalled() == 1
    await asyncio.to_thread(faults.clear)  # from another thread, as another process would
    assert await asyncio.wait_for(listing, 10) == [] and faults.stalled() == 0


async def test_filters_ops_keys_ranks_hosts_and_count(started, faults, monkeypatch):
    zero, one = await started(rank=0), await started(rank=1)
    monkeypatch.setenv("TIERED_CKPT_HOST", "node-a")  # the engine's name of this machine
    faults.inject("fail", ranks=[1])
    await zero.write(KEY, memoryview(VALUE))
    with pytest.raises(tc.TierUnavailable):
        await one.write(KEY, memoryview(VALUE))
    faults.clear()
    faults.inject("fail", hosts=["node-b"])
    await one.write(KEY, memoryview(VALUE))  # another machine's fault
    faults.inject("fail", hosts=["node-a"], keys="manifest", ops=["*"])
    await one.write(KEY, memoryview(VALUE))
    with pytest.raises(tc.TierUnavailable):
        await one.read(OTHER)
    with pytest.raises(tc.TierUnavailable):
        await one.missing([KEY, OTHER])  # any of the keys
    faults.clear()
    faults.inject("fail", ops=["delete"], count=2)
    for tier in (zero, one):  # the count is this process's, whatever the driver
        with pytest.raises(tc.TierUnavailable):
            await tier.delete(KEY)
    await zero.delete(KEY)
    assert await zero.list("job/") == []


async def test_write_faults_spare_the_writers_probe_and_probe_names_it(started, faults):
    tier = await started()
    key = probe_key("job", "1a2b", 0)
    assert PROBE in key  # the driver's idea of a probe is layout's
    faults.inject("error")
    await tier.write(key, memoryview(b"probe"))
    await tier.delete(key)
    faults.inject("full", ops=["probe"])
    with pytest.raises(tc.TierFull):
        await tier.write(key, memoryview(b"probe"))


def test_the_control_file_is_shared_by_processes_each_counting_its_own(tmp_path, faults):
    """Another process reads the faults this one injected, and injects one this one reads; count=1 lets one
    operation fail in each process."""
    faults.inject("fail", keys="shared", count=1)
    script = f"""
import asyncio, sys
from concurrent.futures import ThreadPoolExecutor
from tiered_ckpt.storage.tiers.base import start_tier
from tiered_ckpt.testing.faults import FaultControl, FaultyOptions, FaultyTier

async def main():
    options = FaultyOptions(path={str(tmp_path / "disk")!r}, control={str(tmp_path / "faults.json")!r})
    tier = await start_tier(FaultyTier("disk", options), ThreadPoolExecutor(1))
    for attempt in range(2):
        try:
            await tier.write("job/shared", memoryview(b"x"))
            print("wrote", flush=True)
        except Exception as e:
            print(type(e).__name__, flush=True)
    FaultControl({str(tmp_path / "faults.json")!r}).inject("error", ops=["read"])

asyncio.run(main())
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["TierUnavailable", "wrote"]
    assert [f.mode for f in faults.faults()] == ["fail", "error"]

    async def here():
        executor = ThreadPoolExecutor(1)
        tier = await start_tier(FaultyTier("disk", FaultyOptions(path=str(tmp_path / "disk"),
                                                                  control=str(tmp_path / "faults.json"))), executor)
        with pytest.raises(tc.TierUnavailable):  # this process's one failure
            await tier.write("job/shared", memoryview(b"y"))
        await tier.write("job/shared", memoryview(b"y"))
        with pytest.raises(tc.TierError):  # the other process's fault
            await tier.read("job/shared")
        executor.shutdown()

    asyncio.run(here())


def test_stalled_counts_the_operations_held_in_live_processes(tmp_path, faults):
    """A test acts once a save is held (a kill, a failover): stalled() says when, across processes; a process
    killed while stalled leaves its marker behind, which no longer counts."""
    faults.inject("stall", keys="held")
    script = f"""
import asyncio
from concurrent.futures import ThreadPoolExecutor
from tiered_ckpt.storage.tiers.base import start_tier
from tiered_ckpt.testing.faults import FaultyOptions, FaultyTier

async def main():
    options = FaultyOptions(path={str(tmp_path / "disk")!r}, control={str(tmp_path / "faults.json")!r})
    tier = await start_tier(FaultyTier("disk", options), ThreadPoolExecutor(1))
    await tier.write("job/held", memoryview(b"x"))

asyncio.run(main())
"""
    child = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 60
        while faults.stalled() == 0:
            assert child.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        assert faults.stalled() == 1
    finally:
        child.kill()
        child.wait()
    assert faults.stalled() == 0 and len(os.listdir(tmp_path / "faults.json.stalled")) == 1


async def test_the_driver_parses_the_control_file_again_only_when_it_changed(started, faults):
    tier = await started()
    faults.inject("fail", keys="never")
    first = tier._control.current()
    assert tier._control.current() is first  # unchanged: a stat, no parse
    faults.inject("fail", keys="nor-this")
    assert tier._control.current() is not first and len(tier._control.current()) == 2


def test_the_control_file_is_replaced_whole(tmp_path, faults):
    faults.inject("stall", ops=["*"], seconds=1.5, count=3)
    held = json.loads((tmp_path / "faults.json").read_text())["faults"]
    assert [(f["mode"], f["ops"], f["seconds"], f["count"]) for f in held] == [("stall", ["*"], 1.5, 3)]
    faults.clear()
    assert faults.faults() == [] and sorted(os.listdir(tmp_path)) == ["faults.json", "faults.json.lock"]


@pytest.mark.parametrize("kwargs, named", [
    ({"mode": "explode"}, "mode 'explode'"), ({"mode": "fail", "ops": ["write", "rename"]}, "ops"),
    ({"mode": "corrupt"}, "mode 'corrupt' acts on read"), ({"mode": "full", "ops": ["read"]}, "mode 'full'"),
    ({"mode": "fail", "seconds": 2}, "seconds 2"), ({"mode": "stall", "seconds": -1}, "seconds -1"),
    ({"mode": "fail", "count": 0}, "count 0"), ({"mode": "fail", "ranks": ["0"]}, "ranks"),
    ({"mode": "fail", "hosts": "node-a"}, "hosts"), ({"mode": "fail", "keys": ""}, "keys")])
def test_inject_refuses_what_it_cannot_do_naming_the_argument(faults, tmp_path, kwargs, named):
    mode = kwargs.pop("mode")
    with pytest.raises(ValueError, match=named):
        faults.inject(mode, **kwargs)
    assert not (tmp_path / "faults.json").exists()


def test_kind_faulty_is_built_in_and_control_is_required(tmp_path):
    assert driver_class("faulty") is FaultyTier and "faulty" in known_kinds()
    disk = {"name": "disk", "kind": "faulty", "path": str(tmp_path / "disk")}
    for table, message in (({}, "tiers.disk.control'?: is required"), ({"control": " "}, "tiers.disk.control")):
        with pytest.raises(tc.ConfigError, match=message):
            parse_config({"engine": {"index": f"file://{tmp_path}/index"}, "tiers": [{**disk, **table}]})
    config = parse_config({"engine": {"index": f"file://{tmp_path}/index"},
                           "tiers": [{**disk, "control": str(tmp_path / "f.json"), "capacity": "1MiB"}]})
    assert config.tiers[0].options == FaultyOptions(path=str(tmp_path / "disk"), capacity=1 << 20,
                                                    control=str(tmp_path / "f.json"))


def test_the_kind_loads_without_pytest(tmp_path):
    """A fault drill runs where pytest is not installed: the kind's module does not pull in the suites."""
    script = ("import sys; sys.modules['pytest'] = None\n"
              "from tiered_ckpt.tier_kinds import driver_class, known_kinds\n"
              "print(driver_class('faulty').__name__)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "FaultyTier", out.stderr


# -- through the engine: tiers memory + faulty ----------------------------------------------------------------
def stack(tmp_path, shm_dir, agent="auto", **disk):
    return parse_config({
        "engine": {"job": "test", "index": f"file://{tmp_path}/index", "part_size": "64KiB", "agent": agent},
        "tiers": [{"name": "host", "kind": "memory", "path": str(shm_dir / "host"), "keep_last": 2},
                  {"name": "disk", "kind": "faulty", "path": str(tmp_path / "disk"),
                   "control": str(tmp_path / "faults.json"), "backoff": 0.01, **disk}]})


def state(value: float) -> dict:
    return {"w": torch.full((50_000,), value)}


async def settled(handle) -> dict:
    """The save's errors per tier, once every tier is done (whether wait() raises them or not)."""
    with contextlib.suppress(tc.SaveError):
        await handle.wait()
    return handle.errors


async def test_a_full_faulty_tier_fails_the_save_there_only(tmp_path, shm_dir, faults):
    async with tc.Engine(stack(tmp_path, shm_dir)) as engine:
        await (await engine.save(1, state(1.0))).wait()
        faults.inject("full")
        handle = await engine.save(2, state(2.0))
        await handle.wait("host")
        errors = await settled(handle)
        assert set(errors) == {"disk"} and isinstance(errors["disk"], tc.TierFull)
        assert (await engine.status(2)).complete == {"host"}
        out = state(0.0)
        assert (await engine.load(out)).step == 2 and torch.all(out["w"] == 2.0)
        faults.clear()
        await (await engine.save(3, state(3.0))).wait()
        assert (await engine.status(3)).complete == {"host", "disk"}


async def test_a_failing_tier_is_retried_then_given_up_and_one_failure_is_retried_through(tmp_path, shm_dir,
                                                                                          faults):
    # agent off: the retries are counted by the process that writes the tier
    async with tc.Engine(stack(tmp_path, shm_dir, agent="off", retries=2)) as engine:
        await (await engine.save(1, state(1.0))).wait()
        faults.inject("fail", keys="part-", count=1)
        await (await engine.save(2, state(2.0))).wait()  # the one failure was retried
        assert engine.store.io.retried("disk") == 1 and (await engine.status(2)).complete == {"host", "disk"}
        faults.inject("fail", keys="part-")
        errors = await settled(await engine.save(3, state(3.0)))
        assert set(errors) == {"disk"} and isinstance(errors["disk"], tc.TierUnavailable)
        assert "gave up after 3 attempts" in "".join(getattr(errors["disk"], "__notes__", []))


async def test_a_stalled_tier_holds_its_copy_until_cleared_and_the_save_returns_at_once(tmp_path, shm_dir, faults):
    async with tc.Engine(stack(tmp_path, shm_dir)) as engine:
        await (await engine.save(1, state(1.0))).wait()
        faults.inject("stall", keys="step-000000000002")
        handle = await asyncio.wait_for(engine.save(2, state(2.0)), 30)
        await handle.wait("host")
        await asyncio.sleep(0.3)
        assert (await engine.status(2)).complete == {"host"} and not handle.done()
        faults.clear()
        await asyncio.wait_for(handle.wait(), 30)
        assert (await engine.status(2)).complete == {"host", "disk"}


async def test_corrupt_reads_fail_verification_and_the_load_reads_the_part_elsewhere(tmp_path, shm_dir, faults):
    async with tc.Engine(stack(tmp_path, shm_dir)) as engine:
        await (await engine.save(1, state(1.0))).wait()
        faults.inject("corrupt", ops=["read"], keys="part-")
        with pytest.raises(tc.IntegrityError, match="no tier returned it intact.*disk"):
            await engine.load(state(0.0), tiers=["disk"])
        out = state(0.0)
        info = await engine.load(out)
        assert info.step == 1 and info.tier == "host" and torch.all(out["w"] == 1.0)


async def test_values_that_vanish_before_the_commit_keep_the_copy_from_committing(tmp_path, shm_dir, faults):
    async with tc.Engine(stack(tmp_path, shm_dir)) as engine:
        faults.inject("vanish", keys="part-")
        errors = await settled(await engine.save(1, state(1.0)))
        assert set(errors) == {"disk"} and isinstance(errors["disk"], tc.TierNotFound)
        assert "vanished" in str(errors["disk"]) and (await engine.status(1)).complete == {"host"}


async def test_a_quick_clear_and_inject_of_the_same_fault_is_seen_as_new(started, faults, tmp_path):
    """clear() then inject() of the same fault, faster than the file system's clock ticks, can reuse the old
    file's size and inode number: each version's mtime still moves on, so the driver reads it (its count anew)."""
    tier = await started()
    for _ in range(20):
        faults.inject("fail", count=1)
        with pytest.raises(tc.TierUnavailable):
            await tier.write(KEY, memoryview(VALUE))
        await tier.write(KEY, memoryview(VALUE))  # used up
        faults.clear()
    ahead = os.stat(tmp_path / "faults.json").st_mtime_ns + 10**10  # a version stamped by a clock that ticked late
    os.utime(tmp_path / "faults.json", ns=(ahead, ahead))
    faults.clear()
    assert os.stat(tmp_path / "faults.json").st_mtime_ns > ahead  # (the old code stamped it now: the same or older)
