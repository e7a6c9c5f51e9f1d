"""One conformance suite every tier driver passes. Subclass TierConformance and provide a `tier` fixture
(an opened driver, empty). Later drivers (redis, s3) run the same class."""
from __future__ import annotations

import asyncio
import os

import pytest

from tiered_ckpt.errors import TierNotFound
from tiered_ckpt.tiers.base import PartKey, manifest_key, step_prefix


def payload(n: int, seed: int = 0) -> bytes:
    return bytes((i * 31 + seed) & 0xFF for i in range(n)) if n < 4096 else os.urandom(n)


class TierConformance:
    async def test_write_then_read_into_scatter(self, tier):
        data = payload(300_000)
        key = PartKey("job", 1, 0, 0).path
        await tier.write(key, memoryview(data))
        a, b, c = bytearray(1000), bytearray(200_000), bytearray(99_000)
        n = await tier.read_into(key, [memoryview(a), memoryview(b), memoryview(c)])
        assert n == len(data) and bytes(a + b + c) == data

    async def test_read_whole_value(self, tier):
        await tier.write(manifest_key("job", 3), memoryview(b"manifest bytes"))
        assert await tier.read(manifest_key("job", 3)) == b"manifest bytes"

    async def test_missing_key_raises_not_found(self, tier):
        with pytest.raises(TierNotFound) as err:
            await tier.read_into(PartKey("job", 9, 0, 0).path, [memoryview(bytearray(4))])
        assert isinstance(err.value, LookupError) and tier.name in str(err.value)
        with pytest.raises(TierNotFound):
            await tier.read(manifest_key("job", 9))

    async def test_length_mismatch_is_reported_not_hidden(self, tier):
        key = PartKey("job", 1, 0, 1).path
        await tier.write(key, memoryview(b"short"))
        assert await tier.read_into(key, [memoryview(bytearray(10))]) == 5

    async def test_overwrite_replaces_value(self, tier):
        key = PartKey("job", 1, 0, 2).path
        await tier.write(key, memoryview(b"first version"))
        await tier.write(key, memoryview(b"second"))
        assert await tier.read(key) == b"second"

    async def test_empty_value(self, tier):
        key = PartKey("job", 1, 0, 3).path
        await tier.write(key, memoryview(b""))
        assert await tier.read_into(key, []) == 0

    async def test_list_and_delete_prefix(self, tier):
        for step in (1, 2):
            for p in range(3):
                await tier.write(PartKey("job", step, 0, p).path, memoryview(b"x"))
        await tier.write(PartKey("other", 1, 0, 0).path, memoryview(b"y"))
        assert len(await tier.list(step_prefix("job", 1))) == 3
        assert len(await tier.list("job/")) == 6
        await tier.delete(step_prefix("job", 1))
        assert await tier.list(step_prefix("job", 1)) == []
        assert len(await tier.list("job/")) == 3
        assert await tier.read(PartKey("other", 1, 0, 0).path) == b"y"
        await tier.delete(step_prefix("job", 7))  # absent: not an error

    async def test_concurrent_writes_and_reads(self, tier):
        datas = [payload(50_000) for _ in range(16)]
        await asyncio.gather(*(tier.write(PartKey("job", 5, 0, i).path, memoryview(d)) for i, d in enumerate(datas)))
        bufs = [bytearray(50_000) for _ in datas]
        ns = await asyncio.gather(*(tier.read_into(PartKey("job", 5, 0, i).path, [memoryview(b)])
                                    for i, b in enumerate(bufs)))
        assert ns == [50_000] * 16 and bufs == [bytearray(d) for d in datas]

    async def test_scatter_into_more_buffers_than_iov_max(self, tier):
        data = payload(5000 * 8)
        key = PartKey("job", 6, 0, 0).path
        await tier.write(key, memoryview(data))
        bufs = [bytearray(8) for _ in range(5000)]
        assert await tier.read_into(key, [memoryview(b) for b in bufs]) == len(data)
        assert b"".join(bufs) == data
