"""S3 alone restores: a fresh machine (new process, empty index, no local tiers) finds the newest complete
checkpoint from the manifests on S3, and reshards it into another world size."""
import pytest
import torch

import tiered_ckpt as tc
from tiered_ckpt.testing import configs
from tiered_ckpt.layout import rank_meta_key


def stack(tmp_path, index_dir, endpoint, bucket, *, local: bool, every: int = 1, adopt: bool = False):
    s3 = {"kind": "s3", "bucket": bucket, "prefix": "runs", "endpoint_url": endpoint, "every": every, "keep_last": 2}
    return configs.stack(tmp_path, *(["local"] if local else []), s3, job="gpt", index=f"file://{index_dir}",
                         adopt=adopt)


def state(value: float) -> dict:
    return {"w": torch.full((40_000,), value), "extra": {"lr": value}}


async def test_fresh_machine_restores_from_s3_only(tmp_path, s3_bucket):
    async with tc.Engine(stack(tmp_path, tmp_path / "index", *s3_bucket, local=True, every=2)) as engine:
        for step in range(1, 8):
            await (await engine.save(step, state(float(step)))).wait()
        assert [c.step for c in [c async for c in engine.list()] if "s3" in c.complete] == [4, 6]  # every=2, keep 2
    async with tc.Engine(stack(tmp_path, tmp_path / "fresh-index", *s3_bucket, local=False)) as engine:
        with pytest.raises(tc.IncompleteCheckpoint):  # another index's checkpoints are not taken silently
            await engine.load(state(0.0))
        assert {c.step: c.foreign for c in [c async for c in engine.list()]} == {}  # the new index is empty
    fresh = stack(tmp_path, tmp_path / "fresh-index", *s3_bucket, local=False, adopt=True)
    async with tc.Engine(fresh) as engine:
        out = state(0.0)
        info = await engine.load(out)
        assert info.step == 6 and info.tier == "s3" and torch.all(out["w"] == 6.0) and out["extra"] == {"lr": 6.0}
        out = state(0.0)
        assert (await engine.load(out, step=4)).step == 4 and torch.all(out["w"] == 4.0)


async def test_a_half_written_checkpoint_on_s3_is_not_complete(tmp_path, s3_bucket):
    async with tc.Engine(stack(tmp_path, tmp_path / "index", *s3_bucket, local=False)) as engine:
        await (await engine.save(1, state(1.0))).wait()
        await (await engine.save(2, state(2.0))).wait()
        s3 = engine.store.io.driver("s3")
        await s3.delete(rank_meta_key("gpt", 2, 0, engine.incarnation))  # as if the writer died before it
    async with tc.Engine(stack(tmp_path, tmp_path / "fresh-index", *s3_bucket, local=False, adopt=True)) as engine:
        out = state(0.0)
        assert (await engine.load(out)).step == 1 and torch.all(out["w"] == 1.0)


async def test_an_s3_only_restore_passes_over_a_newest_step_whose_record_is_corrupt(tmp_path, s3_bucket, caplog):
    """S3 alone restores, and the newest step's checksum record there is damaged (one flipped byte): the load
    takes the older whole step, naming the damaged record, instead of failing."""
    import logging

    async with tc.Engine(stack(tmp_path, tmp_path / "index", *s3_bucket, local=False)) as engine:
        await (await engine.save(1, state(1.0))).wait()
        await (await engine.save(2, state(2.0))).wait()
        s3, key = engine.store.io.driver("s3"), rank_meta_key("gpt", 2, 0, engine.incarnation)
        record = bytearray(await s3.read(key))
        record[-1] ^= 0x01
        await s3.write(key, memoryview(bytes(record)))
    caplog.set_level(logging.WARNING)
    async with tc.Engine(stack(tmp_path, tmp_path / "fresh-index", *s3_bucket, local=False, adopt=True)) as engine:
        out = state(0.0)
        assert (await engine.load(out)).step == 1 and torch.all(out["w"] == 1.0)
        assert "step 2" in caplog.text and "corrupt" in caplog.text
