"""S3 through a fault-injecting proxy: throttling bursts and dropped connections are retried; persistent
failure and stalls fail within bounds, naming bucket and key; nothing partial is ever committed."""
import pytest
import torch

import tiered_ckpt as tc
from tiered_ckpt.testing import configs

from .fault_proxy import FaultProxy


def stack(tmp_path, endpoint, bucket, **s3):
    s3_tier = {"kind": "s3", "bucket": bucket, "endpoint_url": endpoint, "retries": 4, "backoff": 0.01, **s3}
    return configs.stack(tmp_path, "local", s3_tier, job="faults",
                         role="writer")  # its probe writes are done at open, before a test injects faults


def state(value: float) -> dict:
    return {"w": torch.full((60_000,), value)}


async def test_retries_recover_from_503_bursts_and_resets(tmp_path, s3_bucket):
    upstream, bucket = s3_bucket
    proxy = FaultProxy(upstream)
    async with proxy as url:
        async with tc.Engine(stack(tmp_path, url, bucket)) as engine:
            proxy.inject("slowdown", 3, method="PUT")
            proxy.inject("drop", 2, method="PUT")
            await (await engine.save(1, state(1.0))).wait()
            assert proxy.hits == {"slowdown": 3, "drop": 2}
            # every SlowDown is retried by the pipeline (a reset on a pooled connection may be retried below it)
            assert engine.store.io.retried("s3") >= proxy.hits["slowdown"]
            out = state(0.0)
            info = await engine.load(out, tiers=["s3"])
            assert info.tier == "s3" and torch.all(out["w"] == 1.0)


async def test_persistent_throttling_fails_within_bounds_and_commits_nothing(tmp_path, s3_bucket):
    upstream, bucket = s3_bucket
    proxy = FaultProxy(upstream)
    async with proxy as url:
        async with tc.Engine(stack(tmp_path, url, bucket)) as engine:
            proxy.inject("slowdown", -1, method="PUT")
            handle = await engine.save(1, state(1.0))
            await handle.wait("disk")
            with pytest.raises(tc.TierUnavailable, match=f"s3://{bucket}/faults/step-000000000001/") as err:
                await handle.wait("s3")
            assert "gave up after 5 attempts" in "".join(getattr(err.value, "__notes__", []))
            status = await engine.status(1)
            assert status.complete == {"disk"} and "s3" in status.failed
            keys = await engine.store.io.driver("s3").list("faults/")
            assert not [k for k in keys if k.endswith("manifest.msgpack")]  # never looks complete on S3


async def test_stalled_responses_time_out_and_are_bounded(tmp_path, s3_bucket):
    upstream, bucket = s3_bucket
    proxy = FaultProxy(upstream)
    async with proxy as url:
        config = stack(tmp_path, url, bucket, timeout=0.5, retries=1)
        async with tc.Engine(config) as engine:
            proxy.inject("slow", -1, method="PUT", delay=5.0)
            handle = await engine.save(1, state(1.0))
            with pytest.raises(tc.TierTimeout, match="longer than 0.5s"):
                await handle.wait("s3")
            assert (await engine.status(1)).complete == {"disk"}
