"""`tiered-ckpt verify` checks the index's copies of a checkpoint's manifest and rank records in two index reads,
whatever the number of ranks (the old code made one round trip per rank: 10,240 at 10,240 ranks)."""
from tiered_ckpt.bench.load_metadata import write_checkpoint
from tiered_ckpt.load.verify import verify_index
from tiered_ckpt.storage.index.file import FileIndex
from tiered_ckpt.testing.counting import CountingIndex


async def test_verify_reads_every_rank_record_in_one_batched_read_and_names_a_damaged_one(tmp_path):
    """Failed on the old code: 65 index calls for 64 ranks."""
    index = FileIndex(tmp_path / "index")
    await index.open()
    manifest = await write_checkpoint(index, 64, job="j", step=3)
    (tmp_path / "index" / "j" / "step-000000000003" / "ranks" / "17").write_bytes(b"garbage")
    (tmp_path / "index" / "j" / "step-000000000003" / "ranks" / "40").unlink()
    counting = CountingIndex(index)
    report = await verify_index(counting, manifest)
    assert counting.total == 2 and report.records == 65 and report.unreachable is None
    assert [line.split(":")[0] for line in report.bad] == ["checksums of rank 17", "checksums of rank 40"]
    assert "IncompleteCheckpoint" in report.bad[1]
