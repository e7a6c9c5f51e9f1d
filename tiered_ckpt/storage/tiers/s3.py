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

S3 serves about 3,500 PUTs per second per key prefix, and every key of a job shares one prefix. `spread = N`
(2-256) stores key K under `<prefix>/<hh>/K` with hh = two hex digits of a hash of K modulo N, so a
checkpoint's PUTs fall on N prefixes; listing and deleting visit every one of them. The engine's keys
(layout.py) do not change. A prefix remembers its layout in `<prefix>/.tiered_ckpt-layout` (written by the
first tier opened with spread > 0 on an empty prefix): opening it with another `spread` (or spread on a prefix
that already holds keys of the plain layout, or no spread on a spread one) is a ConfigError at open, never a
silently empty listing.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

from ...errors import ConfigError, TierError, TierNotFound, TierUnavailable
from .base import Tier, scatter

log = logging.getLogger(__name__)
LAYOUT = ".tiered_ckpt-layout"  # under the prefix: {"spread": N} of a prefix written with spread
RETRYABLE_CODES = {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "Throttling",
                   "ThrottlingException", "RequestTimeTooSkewed", "503", "500", "502", "504"}


@dataclass(frozen=True)
class S3Options:
    bucket: str
    prefix: str = ""
    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    multipart_size: int = field(default=16 * 2**20, metadata={"size": True, "min": 5 * 2**20,
                                                              "why": "the S3 minimum part size"})
    concurrency: int = field(default=8, metadata={"min": 1})  # parts or ranges of one value in flight
    # seconds a socket read may stall (the tier's `timeout` bounds a whole operation)
    read_timeout: float = field(default=120.0, metadata={"above": 0})
    # 2-256: keys spread over this many sub-prefixes (S3's request rate is per prefix); 0: off
    spread: int = field(default=0, metadata={"min": 0, "max": 256})


class S3Tier(Tier):
    Options = S3Options

    @classmethod
    def check_options(cls, name: str, options: S3Options) -> None:
        if options.multipart_size < 5 * 2**20:
            raise ConfigError("must be at least 5MiB (the S3 minimum part size)", key=f"tiers.{name}.multipart_size")
        if options.spread != 0 and not 2 <= options.spread <= 256:
            raise ConfigError("must be 0 (off) or between 2 and 256", key=f"tiers.{name}.spread")
        if not options.bucket:
            raise ConfigError("must name a bucket", key=f"tiers.{name}.bucket")

    def __init__(self, name: str, options: S3Options):
        super().__init__(name, options)
        self._prefix = options.prefix.strip("/") + "/" if options.prefix.strip("/") else ""
        self._shards = [f"{i:02x}/" for i in range(options.spread)] if options.spread else [""]
        self._layout_ok = False
        self._layout_lock = asyncio.Lock()
        self._client: Any = None
        self._context: Any = None

    async def open(self) -> None:
        from aiobotocore.config import AioConfig
        from aiobotocore.session import AioSession

        session = AioSession(profile=self.options.profile)
        # botocore's own checksums of every body (CRC32 of a 64 MiB part on the event loop) add nothing to the
        # engine's part checksums and sealed records: only where S3 requires one
        config = AioConfig(retries={"total_max_attempts": 1, "mode": "standard"},
                           max_pool_connections=2 * self.options.concurrency, connect_timeout=10,
                           read_timeout=self.options.read_timeout, request_checksum_calculation="when_required",
                           response_checksum_validation="when_required")
        self._context = session.create_client("s3", endpoint_url=self.options.endpoint_url,
                                              region_name=self.options.region, config=config)
        self._client = await self._context.__aenter__()
        try:
            await self._layout()
        except TierUnavailable:
            pass  # S3 unreachable now: the first operation checks the layout again (and fails as it would)
        except BaseException:
            await self.close()
            raise

    async def _layout(self) -> None:
        """Once: the prefix's layout is this tier's (_check_layout)."""
        if self._layout_ok:
            return
        async with self._layout_lock:
            if not self._layout_ok:
                await self._check_layout()
                self._layout_ok = True

    async def _marker(self) -> bytes | None:
        """The prefix's layout record, or None."""
        name = self._prefix + LAYOUT
        try:
            return await self._call(LAYOUT, "reading", self._get_raw(name), name=name)
        except TierNotFound:
            return None

    async def _check_layout(self) -> None:
        """The prefix's layout is this tier's: refuse, naming both, a spread the keys were not written with."""
        bucket, marker = self.options.bucket, self._prefix + LAYOUT
        where = f"s3://{bucket}/{self._prefix}"
        try:
            body = await self._marker()
        except TierUnavailable:
            raise
        except TierError as e:
            if not self.options.spread:
                return  # e.g. no s3:GetObject on the marker: a plain layout needs none
            raise TierError(f"cannot read the layout of {where} ({e}); a tier with spread needs s3:GetObject and "
                            f"s3:PutObject on {marker}", tier=self.name) from e
        try:
            stored = int(json.loads(body).get("spread", 0)) if body is not None else None
        except (ValueError, TypeError, AttributeError):
            raise TierError(f"{where}{LAYOUT} is not a layout record: {body[:100]!r}", tier=self.name) from None
        key = f"tiers.{self.name}.spread"
        if stored is not None and stored != self.options.spread:
            raise ConfigError(f"{where} holds keys written with spread = {stored}; this tier has spread = "
                              f"{self.options.spread}: set spread = {stored} (or use another prefix)", key=key)
        if stored is None and self.options.spread:
            page = await self._call("", "listing", self._client.list_objects_v2(
                Bucket=bucket, Prefix=self._prefix, MaxKeys=2), name=self._prefix)
            if any(obj["Key"] != marker for obj in page.get("Contents", [])) and await self._marker() != json.dumps(
                    {"spread": self.options.spread}).encode():  # (not another rank's keys, its record just written)
                raise ConfigError(f"{where} holds keys written without spread; this tier has spread = "
                                  f"{self.options.spread}: remove spread (or use another prefix for the spread "
                                  f"layout)", key=key)
            await self._call(LAYOUT, "recording the layout of", self._client.put_object(
                Bucket=bucket, Key=marker, Body=json.dumps({"spread": self.options.spread}).encode()), name=marker)

    async def close(self) -> None:
        if self._context is not None:
            await self._context.__aexit__(None, None, None)
            self._context = self._client = None

    def _key(self, key: str) -> str:
        """The object's name: <prefix>/K, or <prefix>/<hh>/K with spread."""
        if not self.options.spread:
            return self._prefix + key
        shard = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "big") % self.options.spread
        return f"{self._prefix}{shard:02x}/{key}"

    def _fail(self, e: Exception, key: str, what: str, name: str | None = None) -> TierError:
        where = f"s3://{self.options.bucket}/{name if name is not None else self._key(key)}"
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

    async def _call(self, key: str, what: str, coro: Any, name: str | None = None) -> Any:
        """Await an S3 request for `key` (or the object or prefix `name`), naming it in any error."""
        try:
            return await coro
        except TierError:
            raise
        except Exception as e:  # botocore ClientError, aiohttp/botocore connection errors, timeouts
            raise self._fail(e, key, what, name) from e

    async def write(self, key: str, data: memoryview) -> None:
        await self._layout()
        view = memoryview(data).cast("B")
        bucket, full = self.options.bucket, self._key(key)
        size = self.options.multipart_size
        if len(view) <= size:
            body = await self.run_blocking(bytes, view)  # (botocore wants bytes; the copy is off the event loop)
            await self._call(key, "uploading", self._client.put_object(Bucket=bucket, Key=full, Body=body))
            return
        upload = await self._call(key, "starting the upload of",
                                  self._client.create_multipart_upload(Bucket=bucket, Key=full))
        upload_id = upload["UploadId"]
        slots = asyncio.Semaphore(self.options.concurrency)

        async def part(number: int, chunk: memoryview) -> dict[str, Any]:
            async with slots:
                body = await self.run_blocking(bytes, chunk)
                resp = await self._client.upload_part(Bucket=bucket, Key=full, UploadId=upload_id,
                                                      PartNumber=number, Body=body)
                return {"PartNumber": number, "ETag": resp["ETag"]}

        try:
            parts = await asyncio.gather(*(part(i + 1, view[o : o + size])
                                           for i, o in enumerate(range(0, len(view), size))))
            await self._client.complete_multipart_upload(Bucket=bucket, Key=full, UploadId=upload_id,
                                                         MultipartUpload={"Parts": list(parts)})
        except BaseException as e:
            try:  # never leave orphaned parts behind
                await self._client.abort_multipart_upload(Bucket=bucket, Key=full, UploadId=upload_id)
            except Exception as abort:  # S3 keeps the parts (and bills them) until a lifecycle rule removes them
                log.warning("tier %s: the upload of s3://%s/%s failed and could not be aborted either (%s: %s); its "
                            "parts stay until a bucket lifecycle rule (AbortIncompleteMultipartUpload) removes them",
                            self.name, bucket, full, type(abort).__name__, abort)
            if isinstance(e, Exception):
                raise self._fail(e, key, "uploading") from e
            raise

    async def _get_raw(self, name: str) -> bytes:
        resp = await self._client.get_object(Bucket=self.options.bucket, Key=name)
        async with resp["Body"] as body:
            return await body.read()

    async def _get(self, key: str, start: int | None = None, end: int | None = None) -> tuple[bytes, int]:
        """(bytes, the object's total length): the whole object, or bytes [start, end) of it."""
        await self._layout()
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

    async def _keys(self, prefix: str, start: str = "") -> list[tuple[str, str]]:
        """(object name, engine key) of every key starting with `prefix` (and, with `start`, sorting after it:
        the listing starts there), in every shard (concurrently)."""
        paginator = self._client.get_paginator("list_objects_v2")
        keys: list[tuple[str, str]] = []
        slots = asyncio.Semaphore(self.options.concurrency)

        async def walk(shard: str) -> None:
            base = self._prefix + shard
            async with slots:
                after = {"StartAfter": base + start} if start else {}
                async for page in paginator.paginate(Bucket=self.options.bucket, Prefix=base + prefix, **after):
                    keys.extend((obj["Key"], obj["Key"][len(base):]) for obj in page.get("Contents", []))

        await self._layout()
        await asyncio.gather(*(self._call(prefix, "listing", walk(shard), name=self._prefix + shard + prefix)
                               for shard in self._shards))
        return [(name, key) for name, key in keys if key != LAYOUT]

    async def delete(self, prefix: str) -> None:
        names = [name for name, _ in await self._keys(prefix)]
        for i in range(0, len(names), 1000):
            batch = {"Objects": [{"Key": k} for k in names[i : i + 1000]], "Quiet": True}
            reply = await self._call(prefix, "deleting", self._client.delete_objects(
                Bucket=self.options.bucket, Delete=batch), name=batch["Objects"][0]["Key"])
            errors = reply.get("Errors") or []  # a 200 reply may still refuse some keys, one by one
            if errors:
                first = errors[0]
                raise TierError(f"deleting under s3://{self.options.bucket}/{self._prefix}{prefix}: {len(errors)} of "
                                f"{len(batch['Objects'])} object(s) not deleted, first {first.get('Key')}: "
                                f"{first.get('Code')}: {first.get('Message')}", tier=self.name)

    async def list(self, prefix: str) -> list[str]:
        return sorted(key for _, key in await self._keys(prefix))

    async def list_from(self, prefix: str, start: str) -> list[str]:
        """The listing starts at `start` (StartAfter): the requests grow with what is listed, not the history."""
        return sorted(key for _, key in await self._keys(prefix, start) if key >= start)
