"""The S3 tier against a real S3-compatible server process (moto_server)."""
import pytest

from tiered_ckpt.errors import ConfigError, TierNotFound, TierUnavailable
from tiered_ckpt.testing import TierConformance, payload
from tiered_ckpt.storage.tiers.s3 import S3Options, S3Tier


async def connect(endpoint, bucket, **kw):
    tier = S3Tier("s3", S3Options(bucket=bucket, endpoint_url=endpoint, prefix="runs", **kw))
    await tier.open()
    return tier


class TestS3Tier(TierConformance):
    large_value = 11 * 2**20  # a multipart upload of 5, 5 and 1 MiB, read back by ranged GETs
    reports_lost_keys = False  # acknowledged S3 writes are durable: missing() does not ask

    @pytest.fixture
    def make_tier(self, s3_bucket):
        endpoint, bucket = s3_bucket
        return lambda: S3Tier("s3", S3Options(bucket=bucket, endpoint_url=endpoint, prefix="runs",
                                              multipart_size=5 * 2**20))


async def test_failed_multipart_upload_is_aborted(s3_bucket, monkeypatch):
    tier = await connect(*s3_bucket, multipart_size=5 * 2**20)
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
    import boto3  # the server's own view, through a plain client

    uploads = boto3.client("s3", endpoint_url=s3_bucket[0], region_name="us-east-1").list_multipart_uploads(
        Bucket=s3_bucket[1])
    assert not uploads.get("Uploads")  # aborted: no orphaned parts
    with pytest.raises(TierNotFound):
        await tier.read("job/big")
    await tier.close()


def test_multipart_size_below_s3_minimum_is_a_config_error():
    with pytest.raises(ConfigError, match="5MiB"):
        S3Tier("s3", S3Options(bucket="b", multipart_size=2**20))


async def test_a_large_read_is_concurrent_ranged_gets_into_the_buffers(s3_bucket):
    tier = await connect(*s3_bucket, multipart_size=5 * 2**20)
    data = payload(11 * 2**20)
    await tier.write("job/big", memoryview(data))
    ranges = []
    tier._client.meta.events.register(  # the requests botocore really sends
        "before-call.s3.GetObject", lambda params, **_: ranges.append(params["headers"].get("Range")))
    a, b = bytearray(7 * 2**20), bytearray(4 * 2**20)
    assert await tier.read_into("job/big", [memoryview(a), memoryview(b)]) == len(data)
    assert bytes(a + b) == data
    assert sorted(ranges) == ["bytes=0-5242879", "bytes=10485760-11534335", "bytes=5242880-10485759"]
    await tier.close()
