"""S3 (or any S3-compatible store) via aiobotocore.

Values up to `multipart_size` are one PUT; larger ones a multipart upload with `concurrency` parts in
flight, aborted on any failure so no orphaned parts are left behind. Reads of large values are
concurrent ranged GETs scattered straight into the destination buffers. Keys are immutable per
checkpoint, and the engine writes the manifest last, so on S3 a checkpoint is complete exactly when its
manifest and every rank's checksum record exist (listing paginates).

Retries belong to the tier's pipeline (exponential backoff with jitter, bounded): botocore's own retries
are switched off, and throttling (SlowDown, 503), 5xx answers, timeouts and dropped connections become
TierUnavailable naming the bucket and key. Credentials come from the standard AWS chain (environment,
shared config/profile, instance role), never from the TOML.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..errors import ConfigError, TierError, TierNotFound, TierUnavailable
from .base import Tier, scatter

SIZE = {"size": True}
RETRYABLE_CODES = {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "Throttling",
                   "ThrottlingException", "RequestTimeTooSkewed", "503", "500", "502", "504"}


@dataclass(frozen=True)
class S3Options:
    bucket: str
    prefix: str = ""
    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    multipart_size: int = field(default=16 * 2**20, metadata=SIZE)
    concurrency: int = 8
    read_timeout: float = 120.0  # seconds a socket read may stall (the tier's `timeout` bounds a whole operation)


class S3Tier(Tier):
    Options = S3Options

    def __init__(self, name: str, options: S3Options):
        super().__init__(name, options)
        if options.multipart_size < 5 * 2**20:
            raise ConfigError("must be at least 5MiB (the S3 minimum part size)", key=f"tiers.{name}.multipart_size")
        self._prefix = options.prefix.strip("/") + "/" if options.prefix.strip("/") else ""
        self._client: Any = None
        self._context: Any = None

    async def open(self) -> None:
        from aiobotocore.config import AioConfig
        from aiobotocore.session import AioSession

        session = AioSession(profile=self.options.profile)
        config = AioConfig(retries={"total_max_attempts": 1, "mode": "standard"}, max_pool_connections=2 * self.options.concurrency,
                           connect_timeout=10, read_timeout=self.options.read_timeout)
        self._context = session.create_client("s3", endpoint_url=self.options.endpoint_url,
                                              region_name=self.options.region, config=config)
        self._client = await self._context.__aenter__()

    async def close(self) -> None:
        if self._context is not None:
            await self._context.__aexit__(None, None, None)
            self._context = self._client = None

    def _key(self, key: str) -> str:
        return self._prefix + key

    def _fail(self, e: Exception, key: str, what: str) -> TierError:
        where = f"s3://{self.options.bucket}/{self._key(key)}"
        if type(e).__name__ in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"):
            return TierError(f"{what} {where}: no usable AWS credentials ({e}); set them in the environment, a "
                             f"profile or an instance role", tier=self.name)  # not retryable: retrying cannot help
        response = getattr(e, "response", None) or {}  # ClientError has one; connection errors may carry None
        code = str(response.get("Error", {}).get("Code", ""))
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        if code in ("NoSuchKey", "404", "NotFound"):
            return TierNotFound(f"{where} not found", tier=self.name)
        if code in RETRYABLE_CODES or status >= 500 or not code:
            return TierUnavailable(f"{what} {where}: {type(e).__name__}: {e}", tier=self.name)
        return TierError(f"{what} {where}: {code or type(e).__name__}: {e}", tier=self.name)

    async def _call(self, key: str, what: str, coro: Any) -> Any:
        try:
            return await coro
        except TierError:
            raise
        except Exception as e:  # botocore ClientError, aiohttp/botocore connection errors, timeouts
            raise self._fail(e, key, what) from e

    async def write(self, key: str, data: memoryview) -> None:
        view = memoryview(data).cast("B")
        bucket, full = self.options.bucket, self._key(key)
        size = self.options.multipart_size
        if len(view) <= size:
            await self._call(key, "uploading", self._client.put_object(Bucket=bucket, Key=full, Body=bytes(view)))
            return
        upload = await self._call(key, "starting the upload of",
                                  self._client.create_multipart_upload(Bucket=bucket, Key=full))
        upload_id = upload["UploadId"]
        slots = asyncio.Semaphore(self.options.concurrency)

        async def part(number: int, chunk: memoryview) -> dict[str, Any]:
            async with slots:
                resp = await self._client.upload_part(Bucket=bucket, Key=full, UploadId=upload_id,
                                                      PartNumber=number, Body=bytes(chunk))
                return {"PartNumber": number, "ETag": resp["ETag"]}

        try:
            parts = await asyncio.gather(*(part(i + 1, view[o : o + size])
                                           for i, o in enumerate(range(0, len(view), size))))
            await self._client.complete_multipart_upload(Bucket=bucket, Key=full, UploadId=upload_id,
                                                         MultipartUpload={"Parts": list(parts)})
        except BaseException as e:
            try:  # never leave orphaned parts behind
                await self._client.abort_multipart_upload(Bucket=bucket, Key=full, UploadId=upload_id)
            except Exception:
                pass
            if isinstance(e, Exception):
                raise self._fail(e, key, "uploading") from e
            raise

    async def _get(self, key: str, start: int | None = None, end: int | None = None) -> tuple[bytes, int]:
        """(bytes, the object's total length): the whole object, or bytes [start, end) of it."""
        kwargs = {} if start is None else {"Range": f"bytes={start}-{end - 1}"}
        resp = await self._call(key, "reading", self._client.get_object(
            Bucket=self.options.bucket, Key=self._key(key), **kwargs))
        async with resp["Body"] as body:
            data = await self._call(key, "reading", body.read())
        total = int(resp["ContentRange"].rsplit("/", 1)[1]) if start is not None else len(data)
        return data, total

    async def read_into(self, key: str, out: Sequence[memoryview]) -> int:
        expected, size = sum(len(b) for b in out), self.options.multipart_size
        if expected <= size:  # one GET, no HEAD
            data, total = await self._get(key)
            if total == expected:
                await self.run_blocking(scatter, [data], out)
            return total
        slots = asyncio.Semaphore(self.options.concurrency)

        async def fetch(start: int) -> int:
            async with slots:
                chunk, total = await self._get(key, start, min(start + size, expected))
            if total == expected:
                await self.run_blocking(scatter, [chunk], out, start)
            return total

        # every range at once; each Content-Range carries the object's length, so truncation shows
        results = await asyncio.gather(*(fetch(s) for s in range(0, expected, size)), return_exceptions=True)
        if not isinstance(results[0], BaseException) and results[0] != expected:
            return results[0]  # shorter or longer than the manifest says (later ranges may have failed)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return expected

    async def read(self, key: str) -> bytes:
        return (await self._get(key))[0]

    async def _keys(self, prefix: str) -> list[str]:
        paginator = self._client.get_paginator("list_objects_v2")
        keys: list[str] = []

        async def walk() -> None:
            async for page in paginator.paginate(Bucket=self.options.bucket, Prefix=self._key(prefix)):
                keys.extend(obj["Key"] for obj in page.get("Contents", []))

        await self._call(prefix, "listing", walk())
        return keys

    async def delete(self, prefix: str) -> None:
        keys = await self._keys(prefix)
        for i in range(0, len(keys), 1000):
            batch = {"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True}
            await self._call(prefix, "deleting", self._client.delete_objects(Bucket=self.options.bucket, Delete=batch))

    async def list(self, prefix: str) -> list[str]:
        return sorted(k[len(self._prefix):] for k in await self._keys(prefix))
