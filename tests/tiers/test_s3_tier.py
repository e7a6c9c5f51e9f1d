"""The S3 tier against a real S3-compatible server process (moto_server)."""
import pytest

from tiered_ckpt.errors import ConfigError, TierNotFound, TierUnavailable
from tiered_ckpt.tiers.s3 import S3Options, S3Tier

from .conformance import TierConformance, payload


async def opened(endpoint, bucket, **kw):
    tier = S3Tier("s3", S3Options(bucket=bucket, endpoint_url=endpoint, prefix="runs", **kw))
    await tier.open()
    return tier


class TestS3Tier(TierConformance):
    @pytest.fixture
    async def tier(self, s3_bucket):
        t = await opened(*s3_bucket)
        yield t
        await t.close()


async def test_multipart_upload_and_ranged_scatter_read(s3_bucket):
    tier = await opened(*s3_bucket, multipart_size=5 * 2**20)
    data = payload(11 * 2**20)  # 3 parts: 5, 5 and 1 MiB
    await tier.write("job/big", memoryview(data))
    a, b = bytearray(7 * 2**20), bytearray(4 * 2**20)
    assert await tier.read_into("job/big", [memoryview(a), memoryview(b)]) == len(data)
    assert bytes(a + b) == data
    uploads = await tier._client.list_multipart_uploads(Bucket=s3_bucket[1])
    assert not uploads.get("Uploads")  # nothing left in progress
    await tier.close()


async def test_failed_multipart_upload_is_aborted(s3_bucket, monkeypatch):
    tier = await opened(*s3_bucket, multipart_size=5 * 2**20)
    real = tier._client.upload_part
    calls = []

    async def flaky(**kw):
        calls.append(kw["PartNumber"])
        if kw["PartNumber"] == 2:
            raise ConnectionResetError("connection reset by peer")
        return await real(**kw)

    monkeypatch.setattr(tier._client, "upload_part", flaky)
    with pytest.raises(TierUnavailable, match=f"s3://{s3_bucket[1]}/runs/job/big"):
        await tier.write("job/big", memoryview(payload(11 * 2**20)))
    uploads = await tier._client.list_multipart_uploads(Bucket=s3_bucket[1])
    assert not uploads.get("Uploads")  # aborted: no orphaned parts
    with pytest.raises(TierNotFound):
        await tier.read("job/big")
    await tier.close()


def test_multipart_size_below_s3_minimum_is_a_config_error():
    with pytest.raises(ConfigError, match="5MiB"):
        S3Tier("s3", S3Options(bucket="b", multipart_size=2**20))
