"""The Redis peer tier against raw redis.asyncio SET/GET: same server, part size, concurrency and event
loop (uvloop), in the same run. The tier path includes its pipeline (budget, retries), chunking, the
header-last commit and the scatter into destination buffers."""
from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from typing import Any

import redis.asyncio as aioredis

from ..storage.pipeline import TierPipeline
from ..storage.tiers.redis_peer import RedisOptions, RedisPeerTier
from ..testing.servers import start_local_server


class LocalRedis:
    """A throwaway redis-server on a free port (no persistence)."""

    def __enter__(self) -> str:
        self.dir = tempfile.mkdtemp(prefix="tiered_ckpt-redis-")
        self.proc, port = start_local_server(lambda port: [
            "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", self.dir])
        return f"redis://127.0.0.1:{port}/0"

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


async def measure_redis(url: str, total: int, part_size: int, concurrency: int) -> dict[str, Any]:
    parts = max(total // part_size, 1)
    data = memoryview(os.urandom(part_size))
    out: dict[str, Any] = {"redis_bytes": parts * part_size, "redis_part": part_size, "redis_concurrency": concurrency}

    raw = aioredis.Redis(connection_pool=aioredis.BlockingConnectionPool.from_url(
        url, max_connections=concurrency, timeout=None, socket_timeout=300))
    t = time.perf_counter()
    await asyncio.gather(*(raw.set(f"raw:{i}", data) for i in range(parts)))
    out["raw_set"] = time.perf_counter() - t
    t = time.perf_counter()
    values = await asyncio.gather(*(raw.get(f"raw:{i}") for i in range(parts)))
    out["raw_get"] = time.perf_counter() - t
    assert all(len(v) == part_size for v in values)
    del values
    await raw.flushdb()
    await raw.aclose()
    await raw.connection_pool.disconnect()

    tier = RedisPeerTier("peer", RedisOptions(urls=(url,), connections=concurrency, chunk_size=part_size))
    await tier.open()
    pipeline = TierPipeline("peer", workers=concurrency, inflight=concurrency * part_size, retries=3, timeout=300)
    t = time.perf_counter()
    await asyncio.gather(*(pipeline.submit(part_size, lambda i=i: tier.write(f"bench/p{i}", data), "write")
                           for i in range(parts)))
    out["tier_write"] = time.perf_counter() - t
    buffers = [memoryview(bytearray(part_size)) for _ in range(min(parts, concurrency))]
    for b in buffers:
        b[:] = data  # touched, like a load's destination tensors
    t = time.perf_counter()
    lengths = await asyncio.gather(*(pipeline.submit(
        part_size, lambda i=i: tier.read_into(f"bench/p{i}", [buffers[i % len(buffers)]]), "read")
        for i in range(parts)))
    out["tier_read"] = time.perf_counter() - t
    assert all(n == part_size for n in lengths)
    await tier.delete("bench/")
    await tier.close()
    return out


def report_redis(r: dict[str, Any]) -> str:
    gbs = lambda s: r["redis_bytes"] / s / 1e9  # noqa: E731
    lines = [f"Redis tier vs raw redis.asyncio: {r['redis_bytes'] >> 20} MiB in {r['redis_part'] >> 20} MiB parts, "
             f"concurrency {r['redis_concurrency']}, uvloop, one local redis-server", "",
             "| figure | raw redis.asyncio GB/s | tiered_ckpt tier GB/s | tier / raw | target |", "|---|---:|---:|---:|---:|"]
    for label, raw, tier in (("write (SET)", "raw_set", "tier_write"), ("read (GET)", "raw_get", "tier_read")):
        lines.append(f"| {label} | {gbs(r[raw]):.2f} | {gbs(r[tier]):.2f} | {r[raw] / r[tier]:.2f} | ≥ 0.7 |")
    return "\n".join(lines)
