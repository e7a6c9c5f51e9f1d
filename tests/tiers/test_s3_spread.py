"""The S3 tier with `spread`: keys spread over hashed sub-prefixes (S3's request rate is per prefix), against
a real S3-compatible server (moto_server): the Tier conformance suite, the spread itself, a prefix refusing a
layout it was not written with, and an S3-only restore of a spread checkpoint."""
import boto3
import pytest
import torch

import tiered_ckpt as tc
from tiered_ckpt.testing import configs
from tiered_ckpt.errors import ConfigError
from tiered_ckpt.layout import PartKey
from tiered_ckpt.testing import TierConformance
from tiered_ckpt.storage.tiers.s3 import S3Options, S3Tier


class TestS3SpreadTier(TierConformance):
    large_value = 11 * 2**20  # multipart, under one spread name
    reports_lost_keys = False

    @pytest.fixture
    def make_tier(self, s3_bucket):
        endpoint, bucket = s3_bucket
        return lambda: S3Tier("s3", S3Options(bucket=bucket, endpoint_url=endpoint, prefix="runs",
                                              multipart_size=5 * 2**20, spread=16))


async def open_tier(s3_bucket, prefix, spread):
    endpoint, bucket = s3_bucket
    tier = S3Tier("s3", S3Options(bucket=bucket, endpoint_url=endpoint, prefix=prefix, spread=spread))
    await tier.open()
    return tier


def objects(s3_bucket, prefix):
    endpoint, bucket = s3_bucket
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


async def test_one_checkpoints_keys_fall_on_many_prefixes(s3_bucket):
    tier = await open_tier(s3_bucket, "runs", 16)
    keys = [PartKey("job", 1, r, p, "ix-0123abcd/00000000001abcdef").path for r in range(8) for p in range(8)]
    for key in keys:
        await tier.write(key, memoryview(b"x"))
    stored = [o for o in objects(s3_bucket, "runs/") if not o.endswith(".tiered_ckpt-layout")]
    shards = {name.split("/")[1] for name in stored}
    assert len(stored) == 64 and len(shards) >= 12 and shards <= {f"{i:02x}" for i in range(16)}
    assert sorted(name.split("/", 2)[2] for name in stored) == sorted(keys)  # the engine's key under <hh>/
    assert await tier.list("job/") == sorted(keys)
    await tier.delete("job/step-000000000001/")
    assert await tier.list("job/") == [] and objects(s3_bucket, "runs/") == ["runs/.tiered_ckpt-layout"]
    await tier.close()


async def test_a_prefix_refuses_a_layout_it_was_not_written_with(s3_bucket):
    spread = await open_tier(s3_bucket, "a", 16)
    await spread.write("job/x", memoryview(b"1"))
    await spread.close()
    for other in (0, 32):  # the keys would be looked for where they are not: refused, not listed empty
        with pytest.raises(ConfigError, match=f"s3://{s3_bucket[1]}/a/ holds keys written with spread = 16; "
                                              f"this tier has spread = {other}"):
            await open_tier(s3_bucket, "a", other)
    plain = await open_tier(s3_bucket, "b", 0)
    await plain.write("job/x", memoryview(b"1"))
    await plain.close()
    with pytest.raises(ConfigError, match="holds keys written without spread; this tier has spread = 8"):
        await open_tier(s3_bucket, "b", 8)
    again = await open_tier(s3_bucket, "a", 16)  # the same spread: fine
    assert await again.read("job/x") == b"1"
    await again.close()
    with pytest.raises(ConfigError, match="between 2 and 256"):
        S3Tier("s3", S3Options(bucket="b", spread=1))


def stack(tmp_path, index_dir, endpoint, bucket, *, local, adopt=False):
    s3 = {"kind": "s3", "bucket": bucket, "prefix": "runs", "endpoint_url": endpoint, "spread": 16, "keep_last": 2}
    return configs.stack(tmp_path, *(["local"] if local else []), s3, job="gpt", index=f"file://{index_dir}",
                         adopt=adopt)


async def test_retention_and_an_s3_only_restore_with_spread(tmp_path, s3_bucket):
    state = lambda v: {"w": torch.arange(100_000) * v, "extra": {"v": v}}  # noqa: E731  (7 parts of 64 KiB)
    async with tc.Engine(stack(tmp_path, tmp_path / "index", *s3_bucket, local=True)) as engine:
        for step in range(1, 5):
            await (await engine.save(step, state(step))).wait()
        assert [c.step for c in [c async for c in engine.list()] if "s3" in c.complete] == [3, 4]  # keep_last 2
    steps = {name.split("/")[3] for name in objects(s3_bucket, "runs/") if "/step-" in name}
    assert steps == {"step-000000000003", "step-000000000004"}  # retention removed 1 and 2 from every prefix
    async with tc.Engine(stack(tmp_path, tmp_path / "fresh", *s3_bucket, local=False, adopt=True)) as engine:
        out = state(0)
        info = await engine.load(out)
        assert info.step == 4 and info.tier == "s3" and torch.equal(out["w"], state(4)["w"]) and out["extra"] == {"v": 4}
