"""The conformance suite every tier driver passes, built-in or third party.

Subclass `TierConformance` in a pytest module and give it one fixture, `make_tier`: a function that
returns a new, *unopened* driver over one empty store, the same store on every call (two drivers from it
must see each other's writes). The suite starts each driver exactly as the engine does (`start_tier`:
executor, `bind`, `open`) and closes it afterwards:

    class TestMyTier(TierConformance):
        large_value = 12 * 2**20          # optional: a size that exercises your driver's multi-request path

        @pytest.fixture
        def make_tier(self, tmp_path):
            return lambda: MyTier("mine", MyOptions(root=str(tmp_path)))

Needs pytest and pytest-asyncio (asyncio_mode = "auto", or mark the module with pytest.mark.asyncio).
"""
from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable

import pytest

from ..errors import TierError, TierNotFound
from ..layout import PartKey, manifest_key, rank_meta_key, step_prefix
from ..storage.tiers.base import Tier, start_tier


def payload(n: int, seed: int = 0) -> bytes:
    """`n` bytes that differ from any other payload of the same size."""
    return bytes((i * 31 + seed) & 0xFF for i in range(n)) if n < 4096 else os.urandom(n)


async def _retrying(op: Any, *args: Any, attempts: int = 3) -> Any:
    """As the engine calls a driver: through its pipeline, which retries a retryable error (a test S3 server
    answers 500 now and then to concurrent PUTs of one key; a real client retries those too)."""
    for attempt in range(attempts):
        try:
            return await op(*args)
        except TierError as e:
            if not getattr(e, "retryable", False) or attempt == attempts - 1:
                raise
            await asyncio.sleep(0.05 * (attempt + 1))


class TierConformance:
    large_value: int = 3 * 2**20 + 12345  # bytes; subclasses raise it past their chunk or multipart size
    reports_lost_keys: bool = True  # False for a store whose acknowledged writes cannot vanish (missing() → [])

    @pytest.fixture
    async def opened(self, make_tier: Callable[[], Tier]) -> AsyncIterator[Callable[[], "asyncio.Future[Tier]"]]:
        """opened() → a started driver over the store; every one is closed at teardown."""
        started: list[Tier] = []
        executor = ThreadPoolExecutor(4, thread_name_prefix="conformance")

        async def open_one(rank: int = 0) -> Tier:
            started.append(await start_tier(make_tier(), executor, rank=rank, world_size=2))
            return started[-1]

        yield open_one  # type: ignore[misc]
        for tier in started:
            await tier.close()
        executor.shutdown(wait=True)

    @pytest.fixture
    async def tier(self, opened) -> Tier:  # type: ignore[no-untyped-def]
        return await opened()

    async def test_write_then_read_into_scatter(self, tier):
        data = payload(300_000)
        key = PartKey("job", 1, 0, 0).path
        await tier.write(key, memoryview(data))
        a, b, c = bytearray(1000), bytearray(200_000), bytearray(99_000)
        n = await tier.read_into(key, [memoryview(a), memoryview(b), memoryview(c)])
        assert n == len(data) and bytes(a + b + c) == data

    async def test_large_value_round_trips(self, tier):
        data = payload(self.large_value)
        key = PartKey("job", 1, 0, 7).path
        await tier.write(key, memoryview(data))
        split = self.large_value // 3
        a, b = bytearray(split), bytearray(self.large_value - split)
        assert await tier.read_into(key, [memoryview(a), memoryview(b)]) == len(data)
        assert bytes(a + b) == data
        assert await tier.read(key) == data

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

    async def test_list_from_a_step_on_is_the_listing_from_there(self, tier):
        for step in (3, 10, 12, 200):
            await tier.write(PartKey("job", step, 0, 0).path, memoryview(b"x"))
            await tier.write(rank_meta_key("job", step, 0), memoryview(b"c"))
        await tier.write(PartKey("jobs", 50, 0, 0).path, memoryview(b"y"))  # another job whose name starts alike
        whole = await tier.list("job/")
        for first in (0, 3, 4, 12, 201):
            start = step_prefix("job", first)
            assert await tier.list_from("job/", start) == [k for k in whole if k >= start]
        assert await tier.list_from("nobody/", step_prefix("nobody", 0)) == []

    async def test_list_names_from_a_step_on_are_the_step_folders_from_there(self, tier):
        for step in (3, 10, 12, 200):
            await tier.write(PartKey("job", step, 0, 0).path, memoryview(b"x"))
        await tier.write(PartKey("jobs", 50, 0, 0).path, memoryview(b"y"))
        whole = await tier.list_names("job/")
        assert whole == [step_prefix("job", s)[len("job/"):-1] for s in (3, 10, 12, 200)]
        for first in (0, 3, 4, 12, 201):
            start = step_prefix("job", first)[len("job/"):-1]
            assert await tier.list_names("job/", start) == [n for n in whole if n >= start]
        assert await tier.list_names("nobody/", "step-") == []

    async def test_list_and_delete_prefix(self, tier):
        for step in (1, 2):
            for p in range(3):
                await tier.write(PartKey("job", step, 0, p).path, memoryview(b"x"))
            await tier.write(rank_meta_key("job", step, 0), memoryview(b"c"))
        await tier.write(PartKey("other", 1, 0, 0).path, memoryview(b"y"))
        assert await tier.list(step_prefix("job", 1)) == sorted(
            [PartKey("job", 1, 0, p).path for p in range(3)] + [rank_meta_key("job", 1, 0)])
        assert len(await tier.list("job/")) == 8
        await tier.delete(step_prefix("job", 1))
        assert await tier.list(step_prefix("job", 1)) == []
        assert len(await tier.list("job/")) == 4
        assert await tier.read(PartKey("other", 1, 0, 0).path) == b"y"
        await tier.delete(step_prefix("job", 7))  # absent: not an error

    async def test_missing_reports_only_what_is_gone(self, tier):
        keys = [PartKey("job", 4, 0, p).path for p in range(3)]
        for key in keys:
            await tier.write(key, memoryview(payload(1000, 1)))
        assert await tier.missing(keys) == []
        await tier.delete(step_prefix("job", 4))
        gone = await tier.missing(keys)
        assert gone == (sorted(keys) if self.reports_lost_keys else [])

    async def test_concurrent_writes_and_reads(self, tier):
        datas = [payload(50_000) for _ in range(16)]
        await asyncio.gather(*(tier.write(PartKey("job", 5, 0, i).path, memoryview(d)) for i, d in enumerate(datas)))
        bufs = [bytearray(50_000) for _ in datas]
        ns = await asyncio.gather(*(tier.read_into(PartKey("job", 5, 0, i).path, [memoryview(b)])
                                    for i, b in enumerate(bufs)))
        assert ns == [50_000] * 16 and bufs == [bytearray(d) for d in datas]

    async def test_concurrent_writers_on_one_store(self, opened):
        """Two drivers (two ranks of a job) write at once; each sees both ranks' values, and concurrent
        writes of one key leave one whole value, never a mix."""
        a, b = await opened(0), await opened(1)
        key = manifest_key("job", 8)
        one, two = payload(200_000, 1), payload(200_000, 2)
        await asyncio.gather(*(_retrying(t.write, PartKey("job", 8, r, p).path, memoryview(payload(3000, r)))
                               for r, t in enumerate((a, b)) for p in range(4)),
                             _retrying(a.write, key, memoryview(one)), _retrying(b.write, key, memoryview(two)))
        for t in (a, b):
            assert len(await t.list(step_prefix("job", 8))) == 9
            assert await t.read(PartKey("job", 8, 1, 3).path) == payload(3000, 1)
            assert await t.read(key) in (one, two)

    async def test_scatter_into_more_buffers_than_iov_max(self, tier):
        data = payload(5000 * 8)
        key = PartKey("job", 6, 0, 0).path
        await tier.write(key, memoryview(data))
        bufs = [bytearray(8) for _ in range(5000)]
        assert await tier.read_into(key, [memoryview(b) for b in bufs]) == len(data)
        assert b"".join(bufs) == data

    async def test_cleanup_hooks_measure_and_never_touch_a_stored_key(self, tier):
        """usage() reports stored sizes (or None: unknown); debris() never names a stored key, and removing
        what it names, however old, leaves every key readable (what `tiered-ckpt gc` relies on)."""
        keys = [PartKey("job", 9, 0, p).path for p in range(3)] + [manifest_key("job", 9)]
        for n, key in enumerate(keys):
            await tier.write(key, memoryview(payload(100 + n)))
        await tier.write(PartKey("other", 9, 0, 0).path, memoryview(b"x"))
        usage = await tier.usage("job/")
        assert usage is None or usage == {key: 100 + n for n, key in enumerate(keys)}
        debris = await tier.debris("job/", 0.0)
        assert not {name for name, _ in debris} & set(keys)
        await tier.remove_debris([name for name, _ in debris], 0.0)
        assert await tier.list("job/") == sorted(keys) and await tier.list("other/") == [PartKey("other", 9, 0, 0).path]
