"""The S3 tier against plain aiobotocore: the same objects uploaded with multipart (same part size and
concurrency) and read back with ranged GETs, same server, same run. With no S3 URL given, a local
moto_server is started: a CPU-bound Python server, so the ratio is what matters, not the GB/s."""
from __future__ import annotations

import asyncio
import os
import shutil
import time
import uuid
from typing import Any

from ..storage.pipeline import TierPipeline
from ..storage.tiers.s3 import S3Options, S3Tier
from ..testing.servers import start_local_server


class LocalS3:
    """A throwaway moto_server on a free port, with test credentials in the environment."""

    def __enter__(self) -> str:
        for name, value in (("AWS_ACCESS_KEY_ID", "bench"), ("AWS_SECRET_ACCESS_KEY", "bench"),
                            ("AWS_DEFAULT_REGION", "us-east-1")):
            os.environ.setdefault(name, value)
        self.proc, port = start_local_server(lambda port: ["moto_server", "-H", "127.0.0.1", "-p", str(port)])
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.wait()


def available() -> bool:
    return shutil.which("moto_server") is not None


async def measure_s3(endpoint: str, total: int, object_size: int, multipart: int, concurrency: int) -> dict[str, Any]:
    from aiobotocore.config import AioConfig
    from aiobotocore.session import AioSession

    objects = max(total // object_size, 1)
    data = os.urandom(object_size)
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    out: dict[str, Any] = {"s3_bytes": objects * object_size, "s3_object": object_size, "s3_multipart": multipart,
                           "s3_concurrency": concurrency}
    config = AioConfig(retries={"total_max_attempts": 1}, max_pool_connections=2 * concurrency)
    async with AioSession().create_client("s3", endpoint_url=endpoint, config=config) as client:
        await client.create_bucket(Bucket=bucket)
        slots = asyncio.Semaphore(concurrency)

        async def upload(key: str) -> None:
            upload_id = (await client.create_multipart_upload(Bucket=bucket, Key=key))["UploadId"]

            async def part(n: int, offset: int) -> dict[str, Any]:
                async with slots:
                    resp = await client.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=n,
                                                    Body=data[offset : offset + multipart])
                    return {"PartNumber": n, "ETag": resp["ETag"]}

            parts = await asyncio.gather(*(part(i + 1, o) for i, o in enumerate(range(0, object_size, multipart))))
            await client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id,
                                                   MultipartUpload={"Parts": list(parts)})

        async def download(key: str) -> int:
            async def piece(offset: int) -> int:
                async with slots:
                    resp = await client.get_object(Bucket=bucket, Key=key,
                                                   Range=f"bytes={offset}-{min(offset + multipart, object_size) - 1}")
                    async with resp["Body"] as body:
                        return len(await body.read())
            return sum(await asyncio.gather(*(piece(o) for o in range(0, object_size, multipart))))

        t = time.perf_counter()
        await asyncio.gather(*(upload(f"raw/{i}") for i in range(objects)))
        out["raw_upload"] = time.perf_counter() - t
        t = time.perf_counter()
        assert sum(await asyncio.gather(*(download(f"raw/{i}") for i in range(objects)))) == out["s3_bytes"]
        out["raw_download"] = time.perf_counter() - t

    tier = S3Tier("s3", S3Options(bucket=bucket, endpoint_url=endpoint, multipart_size=multipart,
                                  concurrency=concurrency))
    await tier.open()
    pipeline = TierPipeline("s3", workers=concurrency, inflight=concurrency * object_size, retries=3, timeout=600)
    view = memoryview(data)
    t = time.perf_counter()
    await asyncio.gather(*(pipeline.submit(object_size, lambda i=i: tier.write(f"tier/{i}", view), "write")
                           for i in range(objects)))
    out["tier_upload"] = time.perf_counter() - t
    buffers = [memoryview(bytearray(object_size)) for _ in range(objects)]
    t = time.perf_counter()
    lengths = await asyncio.gather(*(pipeline.submit(object_size, lambda i=i: tier.read_into(f"tier/{i}", [buffers[i]]),
                                                     "read") for i in range(objects)))
    out["tier_download"] = time.perf_counter() - t
    assert all(n == object_size for n in lengths) and bytes(buffers[0]) == data
    await tier.delete("")
    await tier.close()
    return out


def report_s3(r: dict[str, Any], server: str) -> str:
    mb = lambda s: r["s3_bytes"] / s / 1e6  # noqa: E731
    lines = [f"S3 tier vs plain aiobotocore ({server}): {r['s3_bytes'] >> 20} MiB as {r['s3_object'] >> 20} MiB objects, "
             f"multipart/range size {r['s3_multipart'] >> 20} MiB, concurrency {r['s3_concurrency']}", "",
             "| figure | aiobotocore MB/s | tiered_ckpt tier MB/s | tier / plain | target |", "|---|---:|---:|---:|---:|"]
    for label, raw, tier in (("multipart upload", "raw_upload", "tier_upload"),
                             ("ranged download", "raw_download", "tier_download")):
        lines.append(f"| {label} | {mb(r[raw]):.1f} | {mb(r[tier]):.1f} | {r[raw] / r[tier]:.2f} | ≥ 0.8 |")
    return "\n".join(lines)
