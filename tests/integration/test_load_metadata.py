"""A loading rank's metadata phase (the manifest and every saved rank's checksum record) makes the same number
of index round trips whatever the number of saved ranks, on both indexes; an index without the batched read (a
third party's) still loads, one record at a time."""
import pytest

from tiered_ckpt.bench.load_metadata import read_metadata, write_checkpoint
from tiered_ckpt.storage.index.file import FileIndex
from tiered_ckpt.storage.index.redis import RedisIndex

from .test_index_conformance import WithoutBatchedReads


@pytest.fixture(params=["file", "redis"])
def make_index(request, tmp_path):
    if request.param == "file":
        return lambda: FileIndex(tmp_path / "index")
    url = request.getfixturevalue("redis_server")().url
    return lambda: RedisIndex(url)


async def _round_trips(index, ranks: int, job: str) -> int:
    await index.open()
    index.epoch = await index.fence(job)
    written = await write_checkpoint(index, ranks, job=job)
    manifest, trips, _, _ = await read_metadata(index, job=job)
    assert [r.rank for r in manifest.ranks] == list(range(ranks)) and manifest.nbytes == written.nbytes
    assert all(len(r.checksums) == 4 and r.skeleton for r in manifest.ranks)  # every record read and verified
    await index.close()
    return trips


async def test_round_trips_do_not_grow_with_the_saved_world(make_index):
    few, many = await _round_trips(make_index(), 4, "few"), await _round_trips(make_index(), 300, "many")
    assert few == many <= 2  # the manifest, then every record at once (before: one round trip per rank)


async def test_an_index_without_the_batched_read_still_reads_every_record(tmp_path):
    assert await _round_trips(WithoutBatchedReads(FileIndex(tmp_path / "index")), 5, "legacy") == 1 + 5


async def test_a_manifest_of_a_sharded_world_reads_back_whole_through_the_index(make_index):
    """A manifest of 300 FSDP2 ranks x 120 tensors (36,000 chunks: its columns are long enough to be kept as views
    of the bytes the index returned) reads back as written, and a rank's reads plan from it."""
    import torch

    from tiered_ckpt.bench.load_metadata import _table
    from tiered_ckpt.bench.plan_scale import rank_boxes
    from tiered_ckpt.load.reads import Boxed, plan_reads

    table = _table(120, "fsdp", 300)
    index = make_index()
    await index.open()
    index.epoch = await index.fence("sharded")
    await write_checkpoint(index, 300, job="sharded", tensors=table)
    manifest, trips, _, _ = await read_metadata(index, job="sharded")
    await index.close()
    assert trips <= 2 and manifest.tensors == table and not manifest.tensors.offsets.flags.writeable
    by_path = manifest.tensors.index_by_path()
    mine = [b for b in rank_boxes("fsdp", 120, 7, 300) if 0 not in b.sizes]
    reads = plan_reads(manifest, {by_path[b.path]: (b.path, Boxed(torch.empty(b.sizes), tuple(b.offsets))) for b in mine})
    assert sorted(reads.dests) == sorted((int(manifest.tensors.rank[c]), int(manifest.tensors.byte_offset[c]))
                                         for c in range(len(manifest.tensors.rank))
                                         if int(manifest.tensors.rank[c]) == 7 and int(manifest.tensors.nbytes[c]))
