import os

import pytest

from tiered_ckpt.errors import TierFull
from tiered_ckpt.testing import TierConformance
from tiered_ckpt.tiers.local import LocalOptions, LocalTier
from tiered_ckpt.tiers.memory import MemoryOptions, MemoryTier


class TestLocalTier(TierConformance):
    @pytest.fixture
    def make_tier(self, tmp_path):
        return lambda: LocalTier("disk", LocalOptions(path=str(tmp_path / "disk")))

    async def test_no_temp_files_left_behind(self, tier):
        await tier.write("job/step-000000000001/rank-00000/part-000000", memoryview(b"abc"))
        names = [f for _, _, fs in os.walk(tier.root) for f in fs]
        assert names == ["part-000000"]


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

    async def test_capacity_counts_what_a_previous_process_left(self, shm_dir, tier):
        await tier.write("job/a", memoryview(bytes(700_000)))
        again = MemoryTier("host", MemoryOptions(path=str(shm_dir / "host"), capacity=1 << 20))
        await again.open()
        with pytest.raises(TierFull):
            await again.write("job/b", memoryview(bytes(700_000)))
