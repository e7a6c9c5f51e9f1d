import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tiered_ckpt.errors import TierError, TierFull, TierNotFound
from tiered_ckpt.testing import TierConformance
from tiered_ckpt.storage.tiers.local import LocalOptions, LocalTier
from tiered_ckpt.storage.tiers.memory import MemoryOptions, MemoryTier


class TestLocalTier(TierConformance):
    @pytest.fixture
    def make_tier(self, tmp_path):
        return lambda: LocalTier("disk", LocalOptions(path=str(tmp_path / "disk")))

    async def test_no_temp_files_left_behind(self, tier):
        await tier.write("job/step-000000000001/rank-00000/part-000000", memoryview(b"abc"))
        names = [f for _, _, fs in os.walk(tier.root) for f in fs]
        assert names == ["part-000000"]

    async def test_opening_creates_nothing_the_first_write_creates_the_folder(self, tmp_path):
        """A reader (`tiered-ckpt ls`, `show`, `verify`) must not bring back a removed tier folder."""
        root = tmp_path / "gone" / "disk"
        tier = LocalTier("disk", LocalOptions(path=str(root), capacity=1 << 20))
        tier.executor = ThreadPoolExecutor(1)
        await tier.open()
        assert not (tmp_path / "gone").exists()
        assert await tier.list("job/") == [] and await tier.usage("job/") == {} and await tier.debris("job/", 0) == []
        with pytest.raises(TierNotFound):
            await tier.read("job/x")
        await tier.delete("job/")
        assert not (tmp_path / "gone").exists()
        await tier.write("job/x", memoryview(b"abc"))
        assert (root / "job" / "x").read_bytes() == b"abc"

    async def test_a_write_whose_folder_sync_fails_after_the_rename_stays_counted(self, tmp_path, monkeypatch):
        """The rename put the bytes in place: a failing fsync of the folder fails the write, but the tier holds
        them, so the capacity must go on counting them (giving them back let the next write overfill it)."""
        import errno
        from tiered_ckpt.storage.tiers import local

        tier = LocalTier("disk", LocalOptions(path=str(tmp_path / "disk"), capacity=1 << 20))
        tier.executor = ThreadPoolExecutor(1)
        await tier.open()

        def failing_sync(path, missing_ok=False):
            raise OSError(errno.EIO, "fsync of the folder failed", str(path))

        monkeypatch.setattr(local, "fsync_dir", failing_sync)
        with pytest.raises(TierError, match="fsync of the folder failed"):
            await tier.write("job/a", memoryview(bytes(600_000)))
        monkeypatch.undo()
        assert await tier.read("job/a") == bytes(600_000)  # in place
        with pytest.raises(TierFull):
            await tier.write("job/b", memoryview(bytes(600_000)))

    async def test_a_retry_beside_a_write_still_running_counts_the_file_once(self, tmp_path, monkeypatch):
        """A tier operation that timed out goes on in its thread while the pipeline retries it: the retry must
        not count the same file again against the capacity (a spurious TierFull, then checkpoints retired
        early to make room). It waits for the write still running, then counts only the difference."""
        import asyncio
        import threading

        tier = LocalTier("disk", LocalOptions(path=str(tmp_path / "disk"), capacity=1 << 20))
        tier.executor = ThreadPoolExecutor(2)
        await tier.open()
        entered, go_on, write = threading.Event(), threading.Event(), LocalTier._write_sync

        def stuck_once(self, path, data):
            if not entered.is_set():
                entered.set()
                assert go_on.wait(10)
            write(self, path, data)

        monkeypatch.setattr(LocalTier, "_write_sync", stuck_once)
        first = asyncio.ensure_future(tier.write("job/a", memoryview(bytes(600_000))))
        assert await asyncio.to_thread(entered.wait, 10)
        retry = asyncio.ensure_future(tier.write("job/a", memoryview(bytes(600_000))))
        await asyncio.wait([retry], timeout=0.5)  # the old code counted it again at once: TierFull
        go_on.set()
        await first
        await retry
        assert await tier.read("job/a") == bytes(600_000)
        await tier.write("job/b", memoryview(bytes(440_000)))  # fits only if job/a is counted once

    async def test_opening_a_path_with_a_file_in_the_way_fails_at_once(self, tmp_path):
        (tmp_path / "file").write_text("not a folder")
        tier = LocalTier("disk", LocalOptions(path=str(tmp_path / "file" / "disk")))
        tier.executor = ThreadPoolExecutor(1)
        with pytest.raises(TierError, match="cannot create directory.*not a directory"):
            await tier.open()

    async def test_debris_is_old_temp_files_and_empty_folders_below_the_prefix(self, tier):
        key = "job/step-000000000001/ix-00000000/s1/rank-00000/part-000000"
        await tier.write(key, memoryview(b"part"))
        old, fresh = time.time() - 7200, tier.root / "job/step-000000000001/ix-00000000/s1/rank-00000/.tmp-x.2"
        stale = tier.root / "job/step-000000000002/ix-00000000/s1/rank-00000/.tmp-part-000000.1"
        stale.parent.mkdir(parents=True)
        stale.write_bytes(b"12345")
        fresh.write_bytes(b"123")
        empty = tier.root / "job/step-000000000003/ix-00000000"
        empty.mkdir(parents=True)
        for path in (stale, *stale.parents[:4], empty, empty.parent):
            os.utime(path, (old, old))
        found = dict(await tier.debris("job/", 3600))
        assert found == {"job/step-000000000002/": 0, str(stale.relative_to(tier.root)): 5,
                         "job/step-000000000003/": 0}
        assert await tier.remove_debris(list(found), 3600) == 5
        assert sorted(os.listdir(tier.root / "job")) == ["step-000000000001"] and fresh.exists()
        assert await tier.read(key) == b"part"
        assert await tier.debris("job/", 3600) == []  # the fresh temp file is not debris yet
        assert [n for n, _ in await tier.debris("job/", 0)] == [str(fresh.relative_to(tier.root))]


class TestMemoryTier(TierConformance):
    large_value = 600_000  # the same driver as local; the small capacity below must hold it

    @pytest.fixture
    def make_tier(self, shm_dir):
        return lambda: MemoryTier("host", MemoryOptions(path=str(shm_dir / "host"), capacity=1 << 20))

    async def test_capacity_is_enforced_with_a_clear_error(self, tier):
        await tier.write("job/a", memoryview(bytes(600_000)))
        with pytest.raises(TierFull, match=r"capacity 1048576 bytes exceeded.*'?host"):
            await tier.write("job/b", memoryview(bytes(600_000)))
        await tier.write("job/a", memoryview(bytes(900_000)))  # replacing a value counts the difference
        await tier.delete("job/")
        await tier.write("job/b", memoryview(bytes(1_000_000)))  # room again after delete

    async def test_a_failed_write_gives_back_what_the_capacity_check_counted(self, tier):
        await tier.write("job/a", memoryview(bytes(600_000)))
        strided = memoryview(bytearray(1_800_000))[::2]  # 900,000 bytes that the write cannot take (not contiguous)
        with pytest.raises(TypeError):
            await tier.write("job/a", strided)
        assert await tier.read("job/a") == bytes(600_000)  # the value it would have replaced is untouched
        await tier.write("job/b", memoryview(bytes(440_000)))  # fits only if the failed write is not counted

    async def test_capacity_counts_what_a_previous_process_left(self, shm_dir, tier):
        await tier.write("job/a", memoryview(bytes(700_000)))
        again = MemoryTier("host", MemoryOptions(path=str(shm_dir / "host"), capacity=1 << 20))
        await again.open()
        with pytest.raises(TierFull):
            await again.write("job/b", memoryview(bytes(700_000)))
